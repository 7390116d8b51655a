#!/usr/bin/env bash
# What every run on the H200 starts with: the `gpu` tests (ctest -L gpu's binaries), then
# optionally GRPO with the policy on the GPU and the GPU benchmarks. Runs from binaries built
# here and carried (BIN, default .devbin, packed by scripts/device_pack.sh: test_*, bench_*,
# rlhost, plugins/, lib/), since the device image has no gtest, Boost or yaml-cpp; the fixtures
# are the source tree's tests/fixtures.
# Logs go to $OUT when set.
#   scripts/device_gpu.sh [tests|gentests|cli|grpo|bench|genbench|genprofile|fp8|all]  (all = tests, fp8, cli, grpo, bench, genbench)
#     fp8: examples/vendor_fp8 (built out of tree, packed as vendor/libvendor_fp8.so): its gpu test,
#          rlhost check-kernels on it, and fp8_cfg.enabled with it loaded
#     fp8bench: its 8192^3 FP8 GEMM beside torch._scaled_mm (bench/fp8/run.sh), then the CUDA
#               engine's training step in bf16 and with FP8 linears (1B and 3B shapes) and the
#               loss after 200 steps of each on one stream; and decoding at batch 64 / 256 in bf16
#               and with FP8 rollouts (FP8_SHAPES, FP8_RECIPES, FP8_MICRO="1 4": micro-batches a step;
#               FP8_GEMM=0, FP8_CURVE=0, FP8_GEN=0 leave parts out)
#     compilepair: the 1B training step beside torch.compile's (loss in the graph), nothing else
#     steptune: the GEMM/rmsnorm/logprob kernel tests with the row kernels and without, the
#               1B step by default (the row kernels and cuBLASLt's candidates timed at first use,
#               one line a tuned shape), without tuning (RLH_KCUDA_GEMM_TUNE=0) and without any of
#               the three (RLH_KCUDA_NORM_BWD_ROWS=0, RLH_KCUDA_HEAD_WIDE=0), twice
#               (STEPTUNE_VARIANTS), the forward with and without tuning (STEPTUNE_FORWARD=0: not),
#               batch-1 decoding with its phases timed on the device and a step's copies packed
#               (STEPTUNE_B1_VARIANTS; STEPTUNE_B1=0: not), then torch.compile's step
#               (TUNE_COMPILE=0: not)
#     epitune: the residual add as the o and down products' epilogue (gemm_add_fwd round_product=0,
#              opt-in: RLH_CUDA_RESIDUAL_EPILOGUE=1) and cuDNN's attention configs timed at a
#              plan's first call (RLH_KCUDNN_TUNE=2 logs
#              them): the GEMM kernel tests, check-kernels' gemm_add_fwd row, the cuDNN attention
#              tests, test_cuda_engine with the epilogue, then steptune's runs with each in turn
#              (EPITUNE_VARIANTS) and the Qwen3-MoE step with and without the epilogue (EPITUNE_MOE=0: not)
#     stepprofile: ncu kernel times of one 1B training step, by kind and by name (#14: what to fuse next)
#     fusedlayer: decode_layer_fwd (one persistent launch a layer at batch 1): its tests, its
#                 check-kernels row, batch-1 decoding with and without it (FUSED_VARIANTS,
#                 FUSED_CASES), its phase stamps (RLH_KCUDA_DL_TRACE) and ncu figures (FUSED_NCU=0: not)
#     overwrite: gradients overwritten after an update instead of cleared by AdamW: the engine's
#                tests, the 1B step with RLH_CUDA_GRAD_OVERWRITE=0|1 (and --loss device), and
#                torch.compile's step
#     fp8forms: every FP8 form of a decoding step's products (weight-only, block, tensor and row
#               scales), their activation quantisation and the bf16 product, at 1-256 rows
#     w8bench: the weight-only FP8 product alone at decoding shapes (bench_fp8_gemm --decode 1),
#              W8BENCH_VARIANTS env A/B, then ncu on its kernel
#     kvfp8: the FP8 KV cache (vllm_cfg.kv_cache_dtype fp8): kernels_cuda's FP8 cache write and
#            paged attention against kernels_cpu (test_cuda_decode), the generator with it
#            (test_generator_cuda), the paged_attention row of check-kernels (bf16xe4m3), then
#            decoding at KVFP8_CASES (b64 b256) with bf16 caches, FP8 caches, and FP8 rollouts
#            with and without FP8 caches (#21's decode ratio)
#            (KVFP8_TESTS=0: the figures only; KVFP8_VARIANTS, KVFP8_TAG: a log suffix)
#     fp8decode: decoding at FP8DEC_CASES (b1 b64 b256) in bf16, FP8 (weight-only products up to 64
#                rows) and FP8 with quantised activations (RLH_GEN_FP8_WEIGHT_ONLY=0), one run
#     fp8engine: the CUDA engine's FP8 linears against bf16 (test_cuda_engine_fp8), delayed scaling's
#                histories through megatron's checkpoints, and the generator's FP8 rollouts, with the
#                vendor's plugin on the plugin path (also part of fp8)
#     genprofile: the generator benchmark alone and ncu per-kernel times of decoding steps
#     ncukernel: one kernel of a decoding run under ncu's sections (NCUK_REGEX, NCUK_VARIANT, ...)
#     l2prefetch: bench_l2_prefetch (a weight warmed in L2 while HBM idles, against cold)
#     fusedprod: the norm inside the product after it, the residual add inside the product before it,
#                paged attention from FP8 codes in registers: tests, check-kernels, batch 1 with
#                and without the fused products, the FP8 cache's figures at batch 64 and 256
#     fp8prod: quantize_fp8 fused into the norms and SwiGLU (vendor_fp8's producer form): its tests,
#              then FP8 rollouts at batch 64 and 256 with and without it (RLH_GEN_FP8_PRODUCER=0)
#     quick: fusedprod's essentials in a short call (kernel tests, check-kernels, batch 1 with and
#            without the fused ops, batch 256 bf16 and FP8 cache, a few generator tests)
#     fp8parity: #21's generation figures again at FP8PARITY_SHAPES (llama3b): bf16 and FP8 rollouts
#                alternated twice at batch 64 and 256, then each one's train-generation mismatch (--parity)
#     decodeab: batch-1 decoding with each 2026-12-06 change withheld in turn (fused add + norm,
#               gate|up with its GLU, PDL, gemv's preload, gate|up on the few-row gemm, whole rows in
#               paged attention; DECODEAB_VARIANTS picks, DECODEAB_CASES="b1 b64") and the kernel tests
#               that hold them bitwise
#     pagedmma: paged_attention's tensor-core kernel (the default; =0 the SIMT one): tests, check-kernels, bench A/B
#     fp8profile: ncu's per-kernel times of one 1B training step, bf16 and FP8 (FP8_PROFILE="none blockwise"), by kind
#     parity: the deterministic mode's bitwise train-generation parity (tests, the sample op's
#             given ids, the 1B shape's mismatch in both modes: bench_generator_cuda --parity)
#     parityab: the 1B shape's default-mode mismatch against the trainer with each deterministic part alone
#     grpostep: the 1B GRPO step on this GPU beside torch_grpo_step.py (bench/grpo_cuda/run.sh)
#     gentests: only the generator's GPU tests and rlhost generate --device cuda (a short run)
#     algos: DPO, RM, PPO (policy and critic) and multi-turn GRPO with megatron on the GPU (#19)
#     realrun: SFT then GRPO entirely on the GPU at a 113M-parameter shape (#16's real run)
#     fp8grpo: the same, then GRPO from that SFT checkpoint in bf16 and with FP8 training and rollouts (#21)
#     cli: rlhost logprobs/generate and the Python package on the GPU against the CPU in float32
#     mpi: several ranks on this GPU over comm_mpi (OpenMPI carried): DP on the CUDA engine, GRPO at DP=2
#     dp: only test_backend_cuda_dp at 2 and 4 ranks (DDP, distributed optimizer, FSDP, HSDP)
#     nccl2: comm_nccl over two GPUs (kind nvidia-h200-x2), healthy and with a rank killed mid-run
#     multigpu: #22 on a host of several GPUs, one rank a GPU (policy.device = cuda by local rank)
#               over comm_nccl: test_backend_cuda_dp at every GPU, then the training step at 1..G
#               GPUs (bench_parallel --device cuda: dtensor FSDP, megatron DDP / distributed
#               optimizer) beside torch FSDP2 / DDP (bench/parallel/torch_fsdp2.py), same shape and
#               per-GPU batch, and the table of tokens/s/GPU, scaling efficiency and ratios.
#               MG_SHAPE=llama1b|llama8b MG_SIZES="1 2 4 8" MG_MODES="fsdp ddp distopt" MG_TESTS=1|0
#               MG_SEQS_PER_GPU=8 MG_LEN=2048 MG_MB_SEQS=2 MG_COMPILE=0|1 (the torch peer compiled)
#     backlog: what earlier sessions built or meant to measure but could not run, most needed
#              first, for one short call (after 2026-12-07's thirty-first session: the generator's
#              tests at the final defaults and with the packed step inputs, steptune on an H200,
#              fusedprod, then genprofile with the FP8 cache)
#   CUDNN=0 scripts/device_gpu.sh ...   the same without kernels_cudnn on the plugin path (the
#                                       engines then take attention from kernels_cuda)
set -uo pipefail
cd "$(dirname "$0")/.."
bin=$(cd "${BIN:-.devbin}" && pwd)
out=${OUT:-/tmp}
what=${1:-tests}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
# The fixtures travel with the tree: tests/fixtures and the engine's own (tests/engine/fixtures),
# linked into one folder.
mkdir -p "$bin/fixtures"
for f in tests/fixtures/*/ tests/engine/fixtures/*/; do ln -sfn "$PWD/$f" "$bin/fixtures/$(basename "$f")"; done
export RLHOST_FIXTURES=$bin/fixtures RLH_KCUDA_PLUGIN=$bin/libkernels_cuda.so
export LD_LIBRARY_PATH=$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
plugins=$bin/plugins
if [ "${CUDNN:-1}" = 0 ]; then plugins=$bin/plugins_nocudnn; fi
export RLH_TEST_PLUGIN_DIR=$plugins RLHOST_PLUGIN_PATH=$plugins RLH_KCUDNN_PLUGIN=$bin/plugins/libkernels_cudnn.so
echo "plugin path: $plugins"
# comm_nccl opens libnccl.so.2 at run time: the image has it in PyTorch's nvidia-nccl wheel (too
# large to carry). NVLink multicast stays off (the device's rule).
nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
[ -n "$nccl_dir" ] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$nccl_dir
export NCCL_NVLS_ENABLE=0
# FP8 rollout variants (fp8prod, ncukernel): sets f (bench_generator_cuda's flags) and e (the
# environment) for variant $1.
fp8_variant() {
  f="--fp8 --kv-fp8" e=""
  case "$1" in
    bf16) f="" ;;
    kvfp8) f="--kv-fp8" ;;  # the FP8 cache alone (bf16 weights)
    fp8w) f="--fp8" ;;      # FP8 weights alone (bf16 cache)
    fp8-noprod) e="RLH_GEN_FP8_PRODUCER=0" ;;
    fp8-nofew) e="VFP8_FEW_ROWS_MAX=0 RLH_GEN_FP8_IN_PRODUCT=0" ;;
    fp8-noqa) e="RLH_GEN_FP8_IN_PRODUCT=0" ;;
    fp8-w8off) e="RLH_GEN_FP8_WEIGHT_ONLY=0" ;;
    fp8-mma16) e="VFP8_FEW_ROWS_WGMMA=0 VFP8_FEW_ROWS_MAX=16" ;;
    fp8-few64) e="VFP8_FEW_ROWS_MAX=64" ;;
    fp8-few64-s4) e="VFP8_FEW_ROWS_MAX=64 VFP8_FEW_ROWS_SPLITS=4" ;;
    fp8-few64-s2) e="VFP8_FEW_ROWS_MAX=64 VFP8_FEW_ROWS_SPLITS=2" ;;
    fp8-few256) e="VFP8_FEW_ROWS_MAX=256" ;;
    fp8-noauto) e="RLH_FP8_AUTOTUNE=0" ;;
  esac
}
rc=0
# rlhost check-kernels on kernels_cuda (the runner a vendor runs on a provider .so): the log to
# $out/$1, its lines matching $2 shown, rc=1 on a failure; further arguments go to the runner.
# A gtest binary with --gtest_brief=1: its output appended to $out/$1, its pass/fail lines and the
# lines matching $2 shown, rc=1 on a failure; the rest is the command (env A=B ... allowed).
run_gtest() {
  local log=$1 pat=$2
  shift 2
  "$@" --gtest_brief=1 2>&1 | tee -a "$out/$log" | grep -E "^\[  (PASSED|FAILED) |Failure|rror${pat:+|$pat}" | head -24
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
}
check_kcuda() {
  local log=$1 pat=$2
  shift 2
  "$bin/rlhost" check-kernels --plugin "$bin/plugins/libkernels_cuda.so" --device cuda:0 "$@" > "$out/$log" 2>&1
  local ck=$?
  grep -E "$pat" "$out/$log" | head -40
  [ "$ck" = 0 ] || rc=1
}
if [ "$what" = backlog ]; then
  # After 2026-12-07's thirty-first session (which started no machine): gentests
  # (test_generator_cuda at the final defaults: its MLA trainer-match case failed with the
  # residual epilogue on, which is opt-in since, and has not run since), gentests_packed (the
  # same with RLH_GEN_PACKED_STEP=1, the packed step inputs, never run), then steptune on an H200
  # (#14's ratio on the goal's GPU; none of the twenty-ninth to thirty-first sessions' changes
  # has run on one; its batch-1 runs time the step's phases and try the packed inputs), then
  # fusedprod (the fused decoding ops' fuller batch-1 A/B) and genprofile with GENPROF_FP8=2;
  # fp8shapes (FP8 rollouts against bf16 at the 3B and 8B shapes, batch 64 and 256) on request.
  # BACKLOG="..." picks (all may pass one call's 600 s).
  for st in ${BACKLOG:-gentests gentests_packed steptune fusedprod genprofile}; do
    if [ "$st" = gentests_packed ]; then
      mkdir -p "$out/packed"  # its logs apart from gentests'
      OUT="$out/packed" RLH_GEN_PACKED_STEP=1 TESTS=test_generator_cuda bash "$0" gentests || rc=1
    elif [ "$st" = fp8shapes ]; then
      # FP8 rollouts against bf16 where the products are a larger share of a step: the 3B and
      # 8B shapes at batch 64 and 256 (2026-12-07: 1.31x / 1.65x and 1.34x / 1.65x)
      for sh in llama3b llama8b; do
        FP8PROD_TESTS=0 FP8PROD_GEMM=0 FP8PROD_SHAPE=$sh FP8PROD_CASES="b64,b256" FP8PROD_VARIANTS="bf16 fp8" \
          bash "$0" fp8prod || rc=1
      done
    elif [ "$st" = genprofile ]; then
      GENPROF_FP8="${GENPROF_FP8:-2}" bash "$0" "$st" || rc=1
    else
      bash "$0" "$st" || rc=1
    fi
  done
  exit $rc
fi
if [ "$what" = tests ] || [ "$what" = all ] || [ "$what" = gentests ]; then
  list="test_kernels_cuda_plugin test_cuda_conformance test_cuda_kernels test_cuda_decode test_kernels_cudnn_plugin
        test_cudnn_graph test_cudnn_attention test_cuda_engine test_cuda_engine_fp8 test_cuda_engine_offload
        test_cuda_engine_fsdp test_cuda_engine_tp test_backend_cuda
        test_backend_cuda_loss
        test_generator_cuda test_comm_nccl"
  [ "$what" = gentests ] && list=test_generator_cuda
  [ -n "${TESTS:-}" ] && list=$TESTS  # e.g. TESTS="test_comm_nccl test_generator_cuda": only these
  for t in $list; do
    [ -x "$bin/$t" ] || continue
    case "$t" in *cudnn*) [ "${CUDNN:-1}" = 0 ] && continue ;; esac
    echo "== $t =="
    "$bin/$t" --gtest_brief=1 2>&1 | tee "$out/$t.log" |
      grep -E "^\[  (PASSED|FAILED|SKIPPED) |bf16 on GPU|on the GPU|fsdp S=|steady state|AdamW|recompute|deadline|FAILED|Failure|rror|cudnn vs|probe:|refused:|repeatable|cuDNN|dlp|graphs|first tokens|equal HF" | head -100
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
  if [ "$what" != gentests ]; then
    # The same runner as test_cuda_conformance, as a vendor would run it on a provider .so.
    echo "== rlhost check-kernels --plugin libkernels_cuda.so --device cuda:0 =="
    check_kcuda check_kernels.log "^(op |FAIL|kernels_cuda on)|error"
  fi
  # The generator on the GPU through the CLI: greedy on a fixture, in bf16.
  echo "== rlhost generate --device cuda =="
  "$bin/rlhost" generate --model tests/fixtures/llama-tiny --prompt-ids 5,17,42 --temperature 0 --max-new-tokens 8 \
    --ignore-eos --json --device cuda > "$out/generate_cuda.log" 2>&1
  [ $? = 0 ] || rc=1
  cat "$out/generate_cuda.log"
fi
if [ "$what" = fp8 ] || [ "$what" = all ]; then
  # The vendor's FP8 plugin, built against the installed SDK (device_pack.sh): every op against
  # float64 references and an FP8 linear layer forward and backward (test_vendor_fp8), then the
  # conformance runner as a vendor runs it, then the FP8 training settings with it loaded.
  so=$bin/vendor/libvendor_fp8.so
  echo "== test_vendor_fp8 ($so) =="
  RLH_VENDOR_FP8_PLUGIN=$so "$bin/test_vendor_fp8" 2>&1 | tee "$out/test_vendor_fp8.log" |
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[       OK|Failure|rror|Which is|Value of|Expected|actual|trace" | head -80
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  echo "== rlhost check-kernels --plugin libvendor_fp8.so --device cuda:0 =="
  "$bin/rlhost" check-kernels --plugin "$so" --device cuda:0 > "$out/check_kernels_fp8.log" 2>&1
  ck=$?
  grep -E "^(op |FAIL|vendor_fp8 on)|^(gemm|amax|quantize_fp8) |error" "$out/check_kernels_fp8.log" | head -20
  [ "$ck" = 0 ] || rc=1
  echo "== fp8_cfg.enabled=true: refused without the plugin, past the host's check with it =="
  for with in "" "--plugin $so"; do
    "$bin/rlhost" --plugin megatron $with --check-config --config examples/configs/grpo_math_1B.yaml \
      ++policy.megatron_cfg.fp8_cfg.enabled=true > /dev/null 2> "$out/fp8_cfg.log"
    got=$?
    echo "plugin [${with:-none}]: exit $got $(grep -E 'error' "$out/fp8_cfg.log" | head -1)"
    # Without the provider: refused (1); with it: past the host's check (0; megatron then refuses
    # the run itself until its engines run FP8 linears).
    [ "$got" = "$([ -z "$with" ] && echo 1 || echo 0)" ] || rc=1
  done
fi
# The plugin path with the vendor's FP8 provider on it: the engines' registries then hold it
# beside kernels_cuda (it answers FP8 operands only; everything else falls through).
fp8_plugins=$bin/plugins_fp8
if [ -f "$bin/vendor/libvendor_fp8.so" ]; then
  mkdir -p "$fp8_plugins"
  for f in "$bin"/plugins/lib*.so "$bin/vendor/libvendor_fp8.so"; do ln -sfn "$f" "$fp8_plugins/"; done
fi
if [ "$what" = fp8engine ] || [ "$what" = fp8 ] || [ "$what" = all ]; then
  echo "== test_cuda_engine_fp8 (vendor_fp8 on the plugin path) =="
  RLH_TEST_PLUGIN_DIR=$fp8_plugins RLH_EXPECT_FP8_PROVIDER=1 "$bin/test_cuda_engine_fp8" --gtest_brief=1 2>&1 |
    tee "$out/test_cuda_engine_fp8.log" | grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|loss|Expected|Which is|actual|rror" | head -60
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  echo "== test_backend_cuda: FP8 delayed scaling's histories through megatron's checkpoints =="
  RLH_TEST_PLUGIN_DIR=$fp8_plugins RLH_EXPECT_FP8_PROVIDER=1 "$bin/test_backend_cuda" --gtest_brief=1 \
    --gtest_filter='BackendCuda.Fp8*' 2>&1 | tee "$out/test_backend_cuda_fp8.log" |
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is|actual|rror" | head -30
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  echo "== test_generator_cuda: FP8 rollouts (vendor_fp8 on the plugin path) =="
  RLH_TEST_PLUGIN_DIR=$fp8_plugins RLH_EXPECT_FP8_PROVIDER=1 "$bin/test_generator_cuda" --gtest_brief=1 \
    --gtest_filter='*Fp8*' 2>&1 | tee "$out/test_generator_cuda_fp8.log" |
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|fp8 rollouts|Expected|Which is|actual|rror" | head -40
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ "$what" = fp8bench ] || [ "${then_bench:-0}" = 1 ]; then
  # Parts can be left out for a short call: FP8_GEMM=0, FP8_CURVE=0, FP8_GEN=0; FP8_RECIPES picks
  # the engine's recipes (none = bf16, its baseline in the same run).
  recipes=${FP8_RECIPES:-none tensorwise blockwise delayed}
  if [ "${FP8_GEMM:-1}" != 0 ]; then
    bench/fp8/run.sh "$bin/bench_fp8_gemm" "$bin/vendor/libvendor_fp8.so" 2>&1 | tee "$out/fp8bench.log" | tail -8
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  fi
  # End to end on the same engine: bf16, then FP8 linears, same run.
  # FP8_MICRO="1 4": steps of 1 and of 4 micro-batches (gradients accumulated, one AdamW update:
  # how RL trainers step, sharing the per-step AdamW and FP8 weight copies).
  for mbn in ${FP8_MICRO:-1}; do
    for shape in ${FP8_SHAPES:-llama1b llama3b}; do
      for r in $recipes; do
        echo "== bench_cuda_engine --shape $shape --fp8 $r --micro $mbn =="
        RLH_TEST_PLUGIN_DIR=$fp8_plugins "$bin/bench_cuda_engine" --shape "$shape" --only train --steps 6 --warmup 2 \
          --fp8 "$r" --micro "$mbn" > "$out/fp8_engine_${shape}_${r}_mb$mbn.log" 2>&1 || rc=1
        grep -E "^(RESULT|train|fp8)|rror" "$out/fp8_engine_${shape}_${r}_mb$mbn.log"
      done
    done
  done
  if [ "${FP8_CURVE:-200}" != 0 ]; then
    for r in $recipes; do
      RLH_TEST_PLUGIN_DIR=$fp8_plugins "$bin/bench_cuda_engine" --shape small --curve "${FP8_CURVE:-200}" --fp8 "$r" \
        > "$out/fp8_curve_$r.log" 2>&1 || rc=1
      grep -E "^RESULT|rror" "$out/fp8_curve_$r.log"
    done
  fi
  # FP8 rollouts: decoding at batch 64 and 256, bf16 then FP8, same run.
  if [ "${FP8_GEN:-1}" != 0 ]; then
    for f in "" --fp8; do
      for c in b64 b256; do
        RLH_TEST_PLUGIN_DIR=$fp8_plugins "$bin/bench_generator_cuda" --case "$c" --repeats 2 $f \
          > "$out/fp8_gen_${c}${f}.log" 2>&1 || rc=1
        grep -E "^RESULT|rror" "$out/fp8_gen_${c}${f}.log"
      done
    done
  fi
fi
if [ "$what" = quick ]; then
  # fusedprod's essentials for a call with little device time left: the kernel tests, check-kernels,
  # batch 1 with and without the fused ops, batch 256 with the bf16 and the FP8 cache, then a few
  # generator tests.
  "$bin/test_cuda_kernels" --gtest_filter='*NormPrologue*:*GluEpilogue*' --gtest_brief=1 2>&1 |
    grep -E "^\[  (PASSED|FAILED)|Failure|Expected|Which is" | head
  "$bin/test_cuda_decode" --gtest_brief=1 2>&1 | grep -E "^\[  (PASSED|FAILED)|Failure|Expected|Which is|actual" | head -20
  "$bin/rlhost" check-kernels --plugin "$bin/plugins/libkernels_cuda.so" --op rmsnorm_gemm_fwd --op gemm_add_fwd \
    --op rope_kv_cache_write --op paged_attention 2>&1 | grep -E "^(op |rmsnorm|gemm_add|rope_kv|paged|FAIL)|error" | head
  for cv in b1:fused b1:withheld b1:fused b1:withheld b256:bf16 b256:kvfp8; do
    c=${cv%%:*} v=${cv##*:} e="" f=""
    [ "$v" = withheld ] && e="RLH_KCUDA_WITHHOLD=rmsnorm_gemm_fwd,gemm_add_fwd,rope_kv_cache_write"
    [ "$v" = kvfp8 ] && f=--kv-fp8
    env $e "$bin/bench_generator_cuda" --shape llama1b --case "$c" --prompt 128 --new 256 --repeats 2 $f 2>&1 |
      tee -a "$out/q_${c}_$v.log" | grep -E "^$c |rror" | sed "s/^/$v: /" | cut -c1-150
  done
  "$bin/test_generator_cuda" --gtest_filter='*GpuFixture*:*GpuDeterministic.*:*Fp8KvCache*' --gtest_brief=1 2>&1 |
    tee "$out/q_gen.log" | grep -E "^\[  (PASSED|FAILED)|Failure|Expected|Which is" | head -20
fi
if [ "$what" = fusedprod ]; then
  # The twenty-fourth session's changes, tests first: the norm inside the product after it and
  # the residual add inside the product before it (rmsnorm_gemm_fwd, gemm_add_fwd: gemv.cu's
  # prologue and epilogue, bitwise the ops), RoPE with the cache write (rope_kv_cache_write), and
  # paged attention over FP8 caches from the codes in registers. Then batch 1 with the fused ops,
  # with them withheld (RLH_KCUDA_WITHHOLD) and without rope_kv_cache_write alone, twice each,
  # batch 256 with and without rope_kv_cache_write, and the FP8 cache's decoding figures against
  # bf16 at batch 64 and 256. FP_GEN_FILTER: the generator tests run (all); FP_RUNS: the decoding
  # runs (case:variant); KVFP8_CASES / KVFP8_VARIANTS as kvfp8's.
  "$bin/test_cuda_kernels" --gtest_filter='*NormPrologue*:*GluEpilogue*' --gtest_brief=1 > "$out/fp_kernels.log" 2>&1 || rc=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is|rror" "$out/fp_kernels.log" | head -20
  "$bin/test_cuda_decode" --gtest_brief=1 > "$out/fp_decode.log" 2>&1 || rc=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is|actual|rror" "$out/fp_decode.log" | head -30
  "$bin/test_generator_cuda" --gtest_filter="${FP_GEN_FILTER:-*}" --gtest_brief=1 > "$out/fp_generator.log" 2>&1 || rc=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is|rror" "$out/fp_generator.log" | head -30
  "$bin/rlhost" check-kernels --plugin "$bin/plugins/libkernels_cuda.so" --op rmsnorm_gemm_fwd --op gemm_add_fwd \
    --op rope_kv_cache_write --op paged_attention > "$out/fp_check.log" 2>&1 || rc=1
  grep -E "^(op |rmsnorm|gemm_add|rope_kv|paged|FAIL)|error" "$out/fp_check.log" | head -8
  # fused: every fused op; withheld: none of the three; noropekv: without rope_kv_cache_write
  for cv in ${FP_RUNS:-b1:fused b1:withheld b1:noropekv b1:fused b1:withheld b1:noropekv b256:fused b256:noropekv}; do
    c=${cv%%:*} v=${cv##*:} e=""
    [ "$v" = withheld ] && e="RLH_KCUDA_WITHHOLD=rmsnorm_gemm_fwd,gemm_add_fwd,rope_kv_cache_write"
    [ "$v" = noropekv ] && e="RLH_KCUDA_WITHHOLD=rope_kv_cache_write"
    env $e "$bin/bench_generator_cuda" --shape llama1b --case "$c" --prompt 128 --new 256 --repeats 2 2>&1 |
      tee -a "$out/fp_${c}_$v.log" | grep -E "^$c |rror" | sed "s/^/$v: /" | cut -c1-140
  done
  KVFP8_TESTS=0 KVFP8_VARIANTS="${KVFP8_VARIANTS:-bf16 kvfp8 fp8+kvfp8}" bash "$0" kvfp8 || rc=1
fi
if [ "$what" = fp8prod ]; then
  # quantize_fp8 fused into the ops that produce a product's input (vendor_fp8's `producer` form:
  # RMSNorm, add + RMSNorm, SwiGLU; cuda_executor's produce_fp8): the vendor's test of the form,
  # the generator's FP8 rollout tests (with the producers, then without), then FP8 rollouts with
  # the FP8 cache at batch 64 and 256, with the producers and with RLH_GEN_FP8_PRODUCER=0, bf16
  # beside, twice each; fp8-noauto: without the FP8 products' autotune (RLH_FP8_AUTOTUNE=0);
  # fp8-nofew / fp8-few64 / fp8-few256: the few-row kernel off / up to 64 / 256 rows
  # (VFP8_FEW_ROWS_MAX; default 16); fp8-few64-s4 / -s2: up to 64 rows with K split at most 4 / 2
  # ways (VFP8_FEW_ROWS_SPLITS); fp8-mma16: mma.sync up to 16 rows; fp8-noqa: o's
  # input by a pass; fp8-w8off: no weight-only products (steps of 1-8 rows then quantise in the
  # product). First the tests (FP8PROD_TESTS=0
  # skips) and bench_fp8_gemm --decode (FP8PROD_GEMM=0 skips). FP8PROD_CASES, FP8PROD_VARIANTS,
  # FP8PROD_SHAPE (bench_generator_cuda's --shape: llama1b, llama3b, llama8b).
  if [ "${FP8PROD_TESTS:-1}" = 1 ]; then
  RLH_VENDOR_FP8_PLUGIN=$bin/vendor/libvendor_fp8.so "$bin/test_vendor_fp8" --gtest_brief=1 \
    --gtest_filter='*Fused*:*Blockwise*:*GemmBlockwise*:*FewRows*:*QuantizeA*:*WeightOnly*' > "$out/fp8prod_vendor.log" 2>&1 || rc=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is|rror" "$out/fp8prod_vendor.log" | head -20
  # with the producers, without them, and with no weight-only products
  for p in RLH_GEN_FP8_PRODUCER=1 RLH_GEN_FP8_PRODUCER=0 RLH_GEN_FP8_WEIGHT_ONLY=0; do
    env $p RLH_TEST_PLUGIN_DIR=$fp8_plugins RLH_EXPECT_FP8_PROVIDER=1 "$bin/test_generator_cuda" \
      --gtest_brief=1 --gtest_filter='*Fp8Rollouts*' > "$out/fp8prod_generator_$p.log" 2>&1 || rc=1
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|fp8 rollouts|Expected|Which is|rror" "$out/fp8prod_generator_$p.log" |
      sed "s/^/$p: /" | head -12
  done
  fi
  # The block-scaled products at decoding's rows: cuBLASLt (block) against the few-row kernel
  # (block_few), the weight-only form and bf16 beside them.
  if [ "${FP8PROD_GEMM:-1}" = 1 ]; then
    "$bin/bench_fp8_gemm" "$bin/vendor/libvendor_fp8.so" --decode 1 --bf16 "$bin/plugins/libkernels_cuda.so" \
      > "$out/fp8prod_gemm.log" 2>&1 || rc=1
    grep -E "^RESULT|rror" "$out/fp8prod_gemm.log" | sed -E 's/RESULT impl=rlhost name=decode_//; s/ (tensor|tensor_fast|rows|rows_fast)_us=[0-9.]+//g; s/ quant[0-9]_us=[0-9.]+//g' | head -24
    # the same with the weights streamed from memory, as a decoding step reads them (--cold 1)
    "$bin/bench_fp8_gemm" "$bin/vendor/libvendor_fp8.so" --decode 1 --cold 1 --bf16 "$bin/plugins/libkernels_cuda.so" \
      > "$out/fp8prod_gemm_cold.log" 2>&1 || rc=1
    grep -E "^RESULT|rror" "$out/fp8prod_gemm_cold.log" | sed -E 's/RESULT impl=rlhost name=decode_/cold: /; s/ (tensor|tensor_fast|rows|rows_fast)_us=[0-9.]+//g; s/ quant[0-9]_us=[0-9.]+//g; s/ [a-z_]+_GBs=[0-9]+//g' | head -24
    # the few-row kernel on mma.sync instead of the warpgroup products (the A/B)
    VFP8_FEW_ROWS_WGMMA=0 "$bin/bench_fp8_gemm" "$bin/vendor/libvendor_fp8.so" --decode 1 > "$out/fp8prod_gemm_mma.log" 2>&1 || rc=1
    grep -E "^RESULT|rror" "$out/fp8prod_gemm_mma.log" | grep -oE "^RESULT impl=rlhost name=decode_[a-z_]+ rows=[0-9]+|rror.*|block_few_us=[0-9.]+" | paste -d' ' - - | sed 's/RESULT impl=rlhost name=decode_/mma.sync: /' | head -24
  fi
  for c in ${FP8PROD_CASES:-b64 b256}; do
    for v in ${FP8PROD_VARIANTS:-bf16 fp8 fp8-noprod fp8 fp8-noprod}; do
      fp8_variant "$v"
      sh=${FP8PROD_SHAPE:-llama1b}
      env $e RLH_TEST_PLUGIN_DIR=$fp8_plugins "$bin/bench_generator_cuda" --shape "$sh" --case "$c" --repeats 2 $f \
        >> "$out/fp8prod_${sh}_${c}_$v.log" 2>&1 || rc=1
      # (c may list cases, b64,b256: one run, the weights made once)
      grep -E "^(${c//,/|}) |rror" "$out/fp8prod_${sh}_${c}_$v.log" | tail -n "$(echo "$c" | tr ',' '\n' | wc -l)" |
        cut -c1-120 | sed "s/^/$sh $v: /"
      grep -oE "fp8_produced=[0-9()/]+" "$out/fp8prod_${sh}_${c}_$v.log" | tail -1 | sed "s/^/$sh $v: /"
    done
  done
fi
if [ "$what" = fp8parity ]; then
  # #21's generation figures at a shape again (FP8PARITY_SHAPES, default llama3b): bf16 and FP8
  # rollouts (FP8 weights and cache) alternated twice at batch 64 and 256, then the
  # train-generation mismatch of each at batch 64 (--parity: the bf16 CUDA engine scores the
  # generated tokens; PARITY lines), the figures the issue asks beside the speed.
  # FP8PARITY_SPEED=0 skips the speed runs; FP8PARITY_VARIANTS (bf16 fp8; kvfp8 and fp8w: the
  # FP8 cache or the FP8 weights alone) picks the mismatch runs.
  for sh in ${FP8PARITY_SHAPES:-llama3b}; do
    [ "${FP8PARITY_SPEED:-1}" = 1 ] &&
      { FP8PROD_TESTS=0 FP8PROD_GEMM=0 FP8PROD_SHAPE=$sh FP8PROD_CASES="b64,b256" FP8PROD_VARIANTS="bf16 fp8 bf16 fp8" \
          bash "$0" fp8prod || rc=1; }
    for v in ${FP8PARITY_VARIANTS:-bf16 fp8}; do
      fp8_variant "$v"
      RLH_TEST_PLUGIN_DIR=$fp8_plugins "$bin/bench_generator_cuda" --shape "$sh" --case b64 --prompt 128 --new 256 \
        --repeats 1 --parity $f > "$out/fp8parity_${sh}_$v.log" 2>&1 || rc=1
      grep -E "^PARITY|^b64 |rror" "$out/fp8parity_${sh}_$v.log" | cut -c1-160 | sed "s/^/$sh $v: /"
    done
  done
fi
if [ "$what" = overwrite ]; then
  # AdamW no longer clears the gradients; the next step's first weight-gradient product of each
  # linear overwrites them (twenty-third session, #14): the CUDA engine's and megatron's GPU
  # tests, then the 1B step with RLH_CUDA_GRAD_OVERWRITE=0 (clearing, as before) and =1 in
  # turn, then torch.compile's step (compilepair's peer).
  for t in test_cuda_engine test_backend_cuda; do
    echo "== $t =="
    "$bin/$t" --gtest_brief=1 2>&1 | tee "$out/$t.log" | grep -E "^\[  (PASSED|FAILED|SKIPPED) |AdamW|Failure|rror" | head -40
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
  # (and the loss on the device, --loss device: one host wait a step, as torch.compile's peer has
  # its loss in the graph)
  for v in 0:host 1:host 1:device 0:host 1:host 1:device; do
    echo "== RLH_CUDA_GRAD_OVERWRITE=${v%%:*} --loss ${v##*:} =="
    RLH_CUDA_GRAD_OVERWRITE=${v%%:*} "$bin/bench_cuda_engine" --shape llama1b --steps "${COMPILE_STEPS:-8}" --only train \
      --loss "${v##*:}" 2>&1 | tee -a "$out/overwrite_bench.log" | grep -E "^(RESULT|train)|rror"
  done
  python3 bench/engine_cuda/bench_torch.py --shape llama1b --steps "${COMPILE_STEPS:-8}" --compile --only train 2>&1 |
    grep -v Warning | tee "$out/compilepair_torch.log" | grep -E "^RESULT|rror|Traceback"
fi
if [ "$what" = compilepair ]; then
  # #14's ratio alone: the 1B training step on the CUDA engine, then HF's model with its loss
  # compiled by torch.compile (the strongest peer), same GPU, same shape (COMPILE_STEPS=8).
  "$bin/bench_cuda_engine" --shape llama1b --steps "${COMPILE_STEPS:-8}" --only train 2>&1 | tee "$out/compilepair_rlhost.log" |
    grep -E "^(RESULT|train|device)|rror"
  python3 bench/engine_cuda/bench_torch.py --shape llama1b --steps "${COMPILE_STEPS:-8}" --compile --only train 2>&1 |
    grep -v Warning | tee "$out/compilepair_torch.log" | grep -E "^RESULT|rror|Traceback"
fi
if [ "$what" = steptune ]; then
  # #14: the kernel tests of the three changes of 2026-12-07 (the GEMM test's beta-1 product is
  # large enough to be tuned), then the 1B step with each off in turn (STEPTUNE_VARIANTS: env
  # settings, commas join several, DEFAULT=1 is none; RLH_KCUDA_GEMM_TUNE=2 prints a line a tuned
  # shape), the forward, batch 1 and torch.compile's step, with the SM clock and power sampled
  # through all of it (clock.csv: a sustained step runs below ncu's 1,980 MHz).
  (nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 200 > "$out/clock.csv" 2>&1 &)
  if [ "${STEPTUNE_TESTS:-1}" != 0 ]; then
    for v in 0 1; do
      echo "== test_cuda_kernels (GEMM, rmsnorm, logprob), RLH_KCUDA_NORM_BWD_ROWS=$v RLH_KCUDA_HEAD_WIDE=$v =="
      run_gtest steptune_kernels.log "" env RLH_KCUDA_NORM_BWD_ROWS=$v RLH_KCUDA_HEAD_WIDE=$v "$bin/test_cuda_kernels" \
        --gtest_filter='CudaGemm.*:CudaElementwise.*:CudaLogprob.*:CudaDeterminism.*'
    done
    echo "== rlhost check-kernels --plugin libkernels_cuda.so --device cuda:0 (rmsnorm_bwd, linear_logprob rows) =="
    check_kcuda steptune_check.log "^(op |FAIL|kernels_cuda on)|rmsnorm|logprob|error"
    echo "== test_cuda_engine =="
    run_gtest steptune_engine.log "" "$bin/test_cuda_engine"
  fi
  all_off=RLH_KCUDA_NORM_BWD_ROWS=0,RLH_KCUDA_HEAD_WIDE=0,RLH_KCUDA_GEMM_TUNE=0
  for v in ${STEPTUNE_VARIANTS:-RLH_KCUDA_GEMM_TUNE=2 RLH_KCUDA_GEMM_TUNE=0 $all_off DEFAULT=1 RLH_KCUDA_GEMM_TUNE=0 $all_off}; do
    echo "== train, $v =="
    env ${v//,/ } "$bin/bench_cuda_engine" --shape llama1b --steps "${COMPILE_STEPS:-8}" --only train 2>&1 |
      tee -a "$out/steptune_train.log" | grep -E "^(RESULT|train)|gemm tune|sdpa tune|rror"
  done
  for v in $([ "${STEPTUNE_FORWARD:-1}" = 0 ] || echo 0 1); do
    echo "== forward, RLH_KCUDA_GEMM_TUNE=$v =="
    RLH_KCUDA_GEMM_TUNE=$v "$bin/bench_cuda_engine" --shape llama1b --steps "${COMPILE_STEPS:-8}" --only forward 2>&1 |
      tee -a "$out/steptune_forward.log" | grep -E "^(RESULT|forward)|rror"
  done
  # #16's batch 1 on this GPU (the figure the H200 goal is about): by default, with the step's
  # phases timed on the device (RLH_GEN_STEP_EVENTS=1: where the wall time goes), with a step's
  # inputs and draws packed into one copy each (RLH_GEN_PACKED_STEP=1, opt-in), with the vocabulary
  # head on the few-row gemm too (RLH_KCUDA_GEMV_MAX above its 262 Mi elements: an H200 profile of
  # 2026-12-05 had cuBLASLt's M = 1 tiles stream it at ~2.1 TB/s), by default again.
  if [ "${STEPTUNE_B1:-1}" != 0 ]; then
    for v in ${STEPTUNE_B1_VARIANTS:-DEFAULT=1 RLH_GEN_STEP_EVENTS=1 RLH_GEN_PACKED_STEP=1 RLH_GEN_PACKED_STEP=1,RLH_GEN_STEP_EVENTS=1 RLH_KCUDA_GEMV_MAX=300000000 DEFAULT=2}; do
      echo "== b1, $v =="
      env ${v//,/ } "$bin/bench_generator_cuda" --shape llama1b --case b1 --prompt 128 --new 256 --repeats 2 2>&1 |
        tee -a "$out/steptune_b1.log" | grep -E "^b1|host between|device per step|rror"
    done
  fi
  if [ "${TUNE_COMPILE:-1}" != 0 ]; then
    python3 bench/engine_cuda/bench_torch.py --shape llama1b --steps "${COMPILE_STEPS:-8}" --compile --only train 2>&1 |
      grep -v Warning | tee "$out/steptune_torch.log" | grep -E "^RESULT|rror|Traceback"
  fi
  pkill -f "nvidia-smi --query-gpu=clocks.sm" 2>/dev/null
  python3 - "$out/clock.csv" <<'PY'
import statistics, sys
r = []
for line in open(sys.argv[1]):
    try:
        a, b = line.split(",")
        r.append((float(a), float(b)))
    except ValueError:
        pass
for lo in (400, 600):
    hot = [a for a, b in r if b > lo]
    if hot:
        print(f"SM clock while the board drew over {lo} W: median {statistics.median(hot):.0f} MHz, min {min(hot):.0f} ({len(hot)} samples of 200 ms)")
PY
fi
if [ "$what" = epitune ]; then
  # #14 (2026-12-07, thirtieth session): the residual epilogue and cuDNN's timed configs.
  echo "== test_cuda_kernels (GEMM: the separate C input) =="
  run_gtest epitune_kernels.log "separate C" "$bin/test_cuda_kernels" --gtest_filter='CudaGemm.*'
  echo "== rlhost check-kernels --plugin libkernels_cuda.so --op gemm_add_fwd =="
  check_kcuda epitune_check.log "^(op |FAIL|kernels_cuda on)|gemm_add|error" --op gemm_add_fwd
  for t in test_cudnn_attention test_kernels_cudnn_plugin; do
    echo "== $t (RLH_KCUDNN_TUNE=2) =="
    run_gtest "epitune_$t.log" "sdpa tune" env RLH_KCUDNN_TUNE=2 "$bin/$t"
  done
  echo "== test_cuda_engine (RLH_KCUDNN_TUNE=2 RLH_CUDA_RESIDUAL_EPILOGUE=1) =="
  run_gtest epitune_engine.log "" env RLH_KCUDNN_TUNE=2 RLH_CUDA_RESIDUAL_EPILOGUE=1 "$bin/test_cuda_engine"
  # (the residual epilogue is opt-in since this stage's first run: =1 turns it on)
  on=RLH_CUDA_RESIDUAL_EPILOGUE=1
  off=RLH_KCUDNN_TUNE=0
  STEPTUNE_TESTS=0 STEPTUNE_VARIANTS="${EPITUNE_VARIANTS:-RLH_KCUDNN_TUNE=2 $off $on DEFAULT=1 $on,$off}" \
    bash "$0" steptune || rc=1
  # The Qwen3-MoE step (#14's "no speed lost": within 3% of 110.7K), with both and without.
  for v in $([ "${EPITUNE_MOE:-1}" = 0 ] || echo DEFAULT=1 "$on"); do
    echo "== qwen3moe train, $v =="
    env ${v//,/ } "$bin/bench_cuda_engine" --shape qwen3moe --steps 8 --only train 2>&1 |
      tee -a "$out/epitune_moe.log" | grep -E "^(RESULT|train)|rror"
  done
fi
if [ "$what" = stepprofile ]; then
  # Where #14's 1B training step goes: Nsight Compute's per-kernel durations over one step
  # (clocks left alone; the first step, so it carries the weights' one-time bf16 cast), by kind
  # and the longest kernels by name. STEP_SHAPE=llama1b|qwen3moe
  # (PROFILE_STEPS=2: two steps, the second alone counted: no probes or cast)
  timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    "$bin/bench_cuda_engine" --shape "${STEP_SHAPE:-llama1b}" --only train --steps "${PROFILE_STEPS:-1}" --warmup 0 \
    > "$out/ncu_step.csv" 2>&1 || rc=1
  SKIP_FIRST=$([ "${PROFILE_STEPS:-1}" = 2 ] && echo 1 || echo 0) python3 bench/engine_cuda/ncu_breakdown.py "$out/ncu_step.csv" 30
fi
if [ "$what" = fp8forms ]; then
  # Every FP8 form of a decoding step's four products at 1-256 rows (weight-only; e4m3 x e4m3 with
  # block, tensor and row scales, the last two with and without fast accumulation), the
  # activation's quantisation each needs, and kernels_cuda's bf16 product beside them (#21: which
  # form can make FP8 rollouts 1.3x bf16 at 64 and 256 rows).
  echo "== bench_fp8_gemm --decode 1 --bf16 libkernels_cuda.so =="
  "$bin/bench_fp8_gemm" "$bin/vendor/libvendor_fp8.so" --decode 1 --bf16 "$bin/plugins/libkernels_cuda.so" 2>&1 |
    tee "$out/fp8forms.log" | sed -E 's/RESULT impl=rlhost name=decode_//'
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ "$what" = w8bench ]; then
  # The weight-only FP8 product alone at a decoding step's shapes (bench_fp8_gemm --decode),
  # with each W8BENCH_VARIANTS env setting (commas: several), then ncu on the default's kernels.
  for v in ${W8BENCH_VARIANTS:-DEFAULT=1 VFP8_W8_MAXG=8 VFP8_W8_MAXG=2 VFP8_W8_SPLITS=1 VFP8_W8_SPLITS=4 VFP8_W8_PDL=0}; do
    echo "== bench_fp8_gemm --decode 1 with $v =="
    env ${v//,/ } "$bin/bench_fp8_gemm" "$bin/vendor/libvendor_fp8.so" --decode 1 2>&1 | tee "$out/w8bench_$v.log" |
      sed -E 's/RESULT impl=rlhost name=decode_//'
  done
  if [ "${W8_NCU:-1}" != 0 ]; then
    # Every weight-only launch of a short run (10 a shape): duration and DRAM throughput; then the
    # full sections of one batch-1 and one 64-row launch.
    timeout 150 ncu --clock-control none --kernel-name regex:weight_only --csv \
      --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread \
      "$bin/bench_fp8_gemm" "$bin/vendor/libvendor_fp8.so" --decode 1 --reps 1 > "$out/w8_ncu.csv" 2>&1
    python3 - "$out/w8_ncu.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10 and r[0].isdigit()]
hdr = next((r for r in csv.reader(open(sys.argv[1])) if "Metric Name" in r), None)
if not hdr: print("ncu: no rows"); sys.exit(0)
iname, ik, iv = hdr.index("Kernel Name"), hdr.index("Metric Name"), hdr.index("Metric Value")
iid = hdr.index("ID")
per = collections.defaultdict(dict)
for r in rows: per[int(r[iid])][r[ik]] = r[iv].replace(",", "")
for i in sorted(per)[::10]:
    m = per[i]
    print(f"launch {i:4d}: {float(m.get('gpu__time_duration.sum', 0)) / 1e3:8.2f} us  dram {m.get('dram__throughput.avg.pct_of_peak_sustained_elapsed', '?'):>6}%  "
          f"grid {m.get('launch__grid_size', '?'):>5}  regs {m.get('launch__registers_per_thread', '?')}")
PY
    # Launches 20 and 100: gate|up at 1 and at 64 rows (10 launches a shape: qkv, o, gate|up, down).
    for at in 20 100; do
      timeout 100 ncu --clock-control none --kernel-name regex:weight_only --launch-skip $at --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        "$bin/bench_fp8_gemm" "$bin/vendor/libvendor_fp8.so" --decode 1 --reps 1 > "$out/w8_ncu_$at.txt" 2>&1
      grep -E "^  [a-z_]+_kernel|Duration|Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Block Limit|Stall|Warp Cycles Per|Cluster|Waves|Mem Busy|Max Bandwidth|L1/TEX Hit|L2 Hit" "$out/w8_ncu_$at.txt" | head -40
    done
  fi
fi
if [ "$what" = kvfp8 ] && [ "${KVFP8_TESTS:-1}" != 0 ]; then  # KVFP8_TESTS=0: the decoding figures only
  "$bin/test_cuda_decode" --gtest_filter='*Fp8*:*CudaPaged.*' --gtest_brief=1 > "$out/kvfp8_decode.log" 2>&1 || rc=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is|actual|rror" "$out/kvfp8_decode.log" | head -30
  "$bin/test_generator_cuda" --gtest_filter='*Fp8KvCache*' > "$out/kvfp8_generator.log" 2>&1 || rc=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |FP8 KV|Failure|Expected|Which is|actual|rror" "$out/kvfp8_generator.log" | head -30
  "$bin/rlhost" check-kernels --plugin "$bin/libkernels_cuda.so" --op paged_attention > "$out/kvfp8_check.log" 2>&1 || rc=1
  grep -E "^(op |paged|FAIL)|error" "$out/kvfp8_check.log" | head -8
fi
if [ "$what" = kvfp8 ]; then
  for c in ${KVFP8_CASES:-b64 b256}; do
    for v in ${KVFP8_VARIANTS:-bf16 kvfp8 fp8 fp8+kvfp8}; do
      f=""
      case "$v" in kvfp8) f=--kv-fp8 ;; fp8) f=--fp8 ;; fp8+kvfp8) f="--fp8 --kv-fp8" ;; esac
      RLH_TEST_PLUGIN_DIR=$fp8_plugins "$bin/bench_generator_cuda" --case "$c" --repeats 2 $f \
        > "$out/kvfp8_${c}_$v${KVFP8_TAG:-}.log" 2>&1 || rc=1
      echo "$v: $(grep -E "^$c |rror" "$out/kvfp8_${c}_$v${KVFP8_TAG:-}.log" | head -2)"
    done
  done
fi
if [ "$what" = fp8decode ]; then
  # FP8 rollouts' decoding against bf16 in one run (the vendor's provider on the plugin path):
  # bf16, FP8 with the weight-only products up to 64 rows (the default), and FP8 with the
  # activations quantised as before (RLH_GEN_FP8_WEIGHT_ONLY=0). FP8DEC_CASES="b1 b64 b256".
  for c in ${FP8DEC_CASES:-b1 b64 b256}; do
    for v in bf16 fp8 fp8-w8a8; do
      f=""; e=""
      [ "$v" != bf16 ] && f=--fp8
      [ "$v" = fp8-w8a8 ] && e="RLH_GEN_FP8_WEIGHT_ONLY=0"
      env $e RLH_TEST_PLUGIN_DIR=$fp8_plugins "$bin/bench_generator_cuda" --case "$c" --repeats 2 $f \
        > "$out/fp8dec_${c}_$v.log" 2>&1 || rc=1
      echo "$v: $(grep -E "^$c |rror" "$out/fp8dec_${c}_$v.log" | head -2)"
    done
  done
fi
if [ "$what" = cli ] || [ "$what" = all ]; then
  # What a user tries first: the same fixture scored and sampled on the CPU (float32) and on the
  # GPU (bfloat16), through the CLI and through the Python package (ctypes over host.h).
  echo "== rlhost logprobs / generate / python on cuda vs cpu =="
  m=tests/fixtures/llama-tiny
  ids=5,17,42,7,99,3,250,11
  for dev in "cpu --precision float32" "cuda --precision bfloat16"; do
    "$bin/rlhost" logprobs --model $m --ids $ids --json --device $dev > "$out/logprobs_${dev%% *}.json" 2>&1 ||
      { rc=1; cat "$out/logprobs_${dev%% *}.json"; }
  done
  python3 - "$out" <<'PY' || rc=1
import json, sys
a = json.load(open(sys.argv[1] + "/logprobs_cpu.json")); b = json.load(open(sys.argv[1] + "/logprobs_cuda.json"))
d = max(abs(x - y) for x, y in zip(a["token_logprobs"][1:], b["token_logprobs"][1:]))
print(f"logprobs cpu fp32 loss {a['loss']:.6f}, cuda bf16 loss {b['loss']:.6f}, max |dlp| {d:.3g}")
sys.exit(0 if d < 5e-2 else 1)
PY
  "$bin/rlhost" generate --model $m --prompt-ids 5,17,42 --temperature 0 --max-new-tokens 8 --ignore-eos --json \
    --device cpu > "$out/generate_cpu.log" 2>&1 || rc=1
  echo "cpu:  $(head -c 300 "$out/generate_cpu.log")"
  RLHOST_LIB=$bin/lib/librlhost.so.0.1 PYTHONPATH=python python3 - <<'PY' 2>&1 | tee "$out/python_cuda.log" || rc=1
import rlhost
h = rlhost.Host()
m = h.model("tests/fixtures/llama-tiny", device="cuda", precision="bfloat16")
lp = m.logprobs([[5, 17, 42, 7, 99, 3, 250, 11]])
print("python cuda logprobs:", [round(float(x), 4) for x in lp.tolist()[0]])
g = h.generator("tests/fixtures/llama-tiny", config={"device": "cuda"})
out = g.generate([[5, 17, 42]], temperature=0.0, max_new_tokens=8, ignore_eos=True)
print("python cuda generate ids:", out.ids.tolist(), "logprobs:", [round(x, 4) for x in out.logprobs.tolist()[0]])
PY
fi
if [ "$what" = nccl2 ]; then
  # comm_nccl over two GPUs of one host, launched torchrun-style (the image has no mpirun): the
  # comm_probe algorithm's checked collectives on the world and tp=2 groups; then rank 1 kills
  # itself at step 2 and rank 0 must exit non-zero within its 5 s deadline (124/137: it hung).
  n=$(nvidia-smi -L | wc -l)
  if [ "$n" -lt 2 ]; then echo "nccl2: needs 2 GPUs, found $n"; rc=1; else
    probe() {  # config, port, tag
      local t0 r
      t0=$(date +%s%N)
      for r in 0 1; do
        (RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$2 timeout -k 5 60 "$bin/rlhost" \
           --plugin "$bin/extra_plugins/libcomm_probe.so" --config "$1" > "$out/$3_rank$r.log" 2>&1
         echo "rank $r rc $? after $(( ($(date +%s%N) - t0) / 1000000 )) ms" >> "$out/$3_rank$r.log") &
      done
      wait
      for r in 0 1; do grep -v "info: kernels_" "$out/$3_rank$r.log" | tail -n 4; done
    }
    echo "== comm_nccl on two GPUs =="
    probe tests/comm/probe_two_gpus.yaml 29555 nccl2
    grep -q "rank 0 rc 0 " "$out/nccl2_rank0.log" && grep -q "rank 1 rc 0 " "$out/nccl2_rank1.log" || rc=1
    echo "== comm_nccl on two GPUs, rank 1 killed at step 2 =="
    sed 's/comm_timeout_s: 30/comm_timeout_s: 5/; s/^  tp: 2$/  tp: 2\n  kill_rank: 1\n  at_step: 2/' \
      tests/comm/probe_two_gpus.yaml > "$out/nccl2_kill.yaml"
    probe "$out/nccl2_kill.yaml" 29556 nccl2_kill
    grep -Eq "rank 0 rc (0|124|137) " "$out/nccl2_kill_rank0.log" && rc=1
  fi
fi
if [ "$what" = multigpu ]; then
  source "$bin/openmpi/env.sh"
  G=$(nvidia-smi -L | wc -l)
  if [ "${MG_TESTS:-1}" = 1 ] && [ "$G" -ge 2 ]; then
    echo "== mpirun -np $G test_backend_cuda_dp (one rank a GPU, comm_nccl) =="
    mpirun -np "$G" "$bin/test_backend_cuda_dp" --gtest_brief=1 2>&1 | tee "$out/multigpu_dp_np$G.log" |
      grep -E "^\[  (PASSED|FAILED|SKIPPED) |device (dp|fsdp)|communicator|Failure|rror" | head -40
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  fi
  m=$(mktemp -d)
  python3 bench/grpo_cuda/make_model.py "$m" --shape "${MG_SHAPE:-llama1b}" --prompts 1 | tail -1 || rc=1
  per=${MG_SEQS_PER_GPU:-8}
  for n in ${MG_SIZES:-1 2 4 8}; do
    [ "$n" -le "$G" ] || continue
    for mode in ${MG_MODES:-fsdp ddp}; do
      case $mode in
        fsdp) flags=(--backend dtensor) ;;
        ddp) flags=(--backend megatron --ddp) ;;
        *) flags=(--backend megatron) ;;
      esac
      echo "== $n GPU(s), $mode: rlhost =="
      RLHOST_PLUGIN_PATH=$plugins timeout 900 mpirun -np "$n" "$bin/bench_parallel" --model "$m/model" "${flags[@]}" \
        --device cuda --seqs $((per * n)) --len "${MG_LEN:-2048}" --mb-seqs "${MG_MB_SEQS:-2}" --steps 3 --warmup 1 2>&1 |
        tee -a "$out/multigpu.log" | grep -E "^RESULT|bench_parallel:" | cut -c1-400
      [ "$mode" = distopt ] && continue  # torch's peers: FSDP2 and DDP
      echo "== $n GPU(s), $mode: torch =="
      compile=(); [ "${MG_COMPILE:-0}" = 1 ] && compile=(--compile)
      timeout 900 python3 -m torch.distributed.run --standalone --nproc_per_node "$n" bench/parallel/torch_fsdp2.py \
        --model "$m/model" --mode "$mode" --seqs $((per * n)) --len "${MG_LEN:-2048}" --mb-seqs "${MG_MB_SEQS:-2}" \
        --steps 3 --warmup 1 "${compile[@]}" 2>&1 | tee -a "$out/multigpu_torch.log" | grep -E "^RESULT|Error" | head -3
    done
  done
  rm -rf "$m"
  cat "$out/multigpu.log" "$out/multigpu_torch.log" 2>/dev/null | grep '^RESULT' | python3 bench/parallel/scaling_table.py
fi
if [ "$what" = grpo ] || [ "$what" = all ]; then
  # The demo's two stages (scripts/demo.sh) with stage 2's policy on the GPU: megatron,
  # policy.device=cuda, bf16; the generator follows policy.device onto the GPU (bf16) and refits
  # from host copies of the device's weights.
  echo "== GRPO with the policy on the GPU =="
  d=$(mktemp -d)
  "$bin/rlh_tiny_model" "$d/tiny_model" --alphabet "0123456789+-*=" --seed 1 >/dev/null
  common=(--plugin environments --plugin tokenizer_hf --plugin model_llama --plugin kernels_cpu)
  "$bin/rlhost" "${common[@]}" --plugin dtensor --plugin sft --config examples/configs/sft_demo_cpu.yaml \
    policy.model_name="$d/tiny_model" checkpointing.checkpoint_dir="$d/sft" logger.log_dir="$d/sft/logs" \
    > "$out/grpo_gpu_sft.log" 2>&1 || { echo "SFT stage failed"; tail -5 "$out/grpo_gpu_sft.log"; rc=1; }
  ckpt=$(ls -d "$d"/sft/step_* 2>/dev/null | sort -t_ -k2 -n | tail -1)
  "$bin/rlhost" "${common[@]}" --plugin megatron --plugin generator --plugin grpo \
    --config examples/configs/grpo_demo_cpu.yaml policy.model_name="$ckpt/policy" \
    checkpointing.checkpoint_dir="$d/grpo" logger.log_dir="$d/grpo/logs" policy.dtensor_cfg.enabled=false \
    ++policy.megatron_cfg.enabled=true ++policy.megatron_cfg.optimizer.lr=1e-3 \
    ++policy.megatron_cfg.optimizer.weight_decay=0 policy.precision=bfloat16 ++policy.device=cuda 2>&1 |
    tee "$out/grpo_gpu.log" | grep -v "^\[rlhost\] step [0-9]*/" | tail -8
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  grep "^\[rlhost\] step" "$out/grpo_gpu.log" | tail -2
fi
if [ "$what" = realrun ] || [ "$what" = fp8grpo ]; then
  # The demo's two stages entirely on the GPU at a >= 100M-parameter shape (hidden 1024, 10
  # layers, 16 heads / 4 kv heads, ffn 2816: 113M with its 20-token vocabulary): SFT (megatron,
  # bf16, cuda) on addition and multiplication, then GRPO on subtraction, which SFT never showed.
  # fp8grpo (#21): from the same SFT checkpoint, GRPO in bf16 and with FP8 training (tensorwise
  # e4m3, the first and last layers in bf16) and FP8 rollouts (blockwise), the vendor's plugin
  # loaded; the two validation curves and the train-generation mismatch side by side.
  echo "== real run: SFT then GRPO on the GPU at 113M parameters =="
  d=$(mktemp -d)
  "$bin/rlh_tiny_model" "$d/model" --alphabet "0123456789+-*=" --seed 1 --hidden 1024 --layers 10 --heads 16 \
    --kv-heads 4 --ffn 2816 --init-std ${INIT_STD:-0.02} > "$out/realrun_model.log" 2>&1 || rc=1
  common=(--plugin environments --plugin tokenizer_hf --plugin model_llama --plugin kernels_cpu --plugin megatron)
  gpu=(policy.dtensor_cfg.enabled=false ++policy.megatron_cfg.enabled=true ++policy.megatron_cfg.optimizer.weight_decay=0
       policy.precision=bfloat16 ++policy.device=cuda)
  t0=$(date +%s)
  "$bin/rlhost" "${common[@]}" --plugin sft --config examples/configs/sft_demo_cpu.yaml policy.model_name="$d/model" \
    checkpointing.checkpoint_dir="$d/sft" logger.log_dir="$d/sft/logs" "${gpu[@]}" \
    ++policy.megatron_cfg.optimizer.lr=${SFT_LR:-5e-4} > "$out/realrun_sft.log" 2>&1 || { echo "SFT stage failed"; rc=1; }
  grep -E "val_loss|validation" "$out/realrun_sft.log" | tail -4
  echo "SFT took $(( $(date +%s) - t0 )) s"
  ckpt=$(ls -d "$d"/sft/step_* 2>/dev/null | sort -t_ -k2 -n | tail -1)
  runs=(bf16)
  [ "$what" = fp8grpo ] && runs=(bf16 fp8)
  for run in "${runs[@]}"; do
    extra=()
    [ "$run" = fp8 ] && extra=(--plugin "$bin/vendor/libvendor_fp8.so" ++policy.megatron_cfg.fp8_cfg.enabled=true
      ++policy.megatron_cfg.fp8_cfg.fp8=e4m3 ++policy.megatron_cfg.fp8_cfg.fp8_recipe=tensorwise
      ++policy.megatron_cfg.fp8_cfg.fp8_param=false ++policy.generation.vllm_cfg.precision=fp8)
    t0=$(date +%s)
    "$bin/rlhost" "${common[@]}" --plugin generator --plugin grpo "${extra[@]}" --config examples/configs/grpo_demo_cpu.yaml \
      policy.model_name="$ckpt/policy" checkpointing.checkpoint_dir="$d/grpo_$run" logger.log_dir="$d/grpo_$run/logs" "${gpu[@]}" \
      ++policy.megatron_cfg.optimizer.lr=${GRPO_LR:-1e-4} grpo.max_num_steps=${GRPO_STEPS:-300} > "$out/realrun_grpo_$run.log" 2>&1 ||
      { echo "GRPO stage ($run) failed"; rc=1; }
    grep -E "^\[rlhost\] step|validation accuracy|parameters|fp8|FP8|error" "$out/realrun_grpo_$run.log" | grep -v "eta --" | tail -8
    echo "GRPO ($run) took $(( $(date +%s) - t0 )) s"
    cp "$d/grpo_$run/logs/metrics.jsonl" "$out/realrun_grpo_${run}_metrics.jsonl" 2>/dev/null
  done
  if [ "$what" = fp8grpo ]; then
    python3 - "$out" <<'PY'
import json, sys
def curve(run):
    val, mism = {}, {}
    for line in open(f"{sys.argv[1]}/realrun_grpo_{run}_metrics.jsonl"):
        m = json.loads(line)
        s = m.get("step")
        for k, v in m.items():
            if k.endswith("validation/accuracy"): val[s] = v
            if k.endswith("token_mult_prob_error"): mism[s] = v
    return val, mism
(vb, mb), (vf, mf) = curve("bf16"), curve("fp8")
mean = lambda d, lo, hi: (lambda v: sum(v) / len(v) if v else float("nan"))([x for s, x in d.items() if lo < s <= hi])
print("step   validation accuracy bf16 / fp8   token_mult_prob_error since the last row, bf16 / fp8")
prev = -1
for s in sorted(set(vb) | set(vf)):
    print(f"{s:5}   {vb.get(s, float('nan')):8.4f} / {vf.get(s, float('nan')):.4f}          {mean(mb, prev, s):.5f} / {mean(mf, prev, s):.5f}")
    prev = s
PY
  fi
fi
if [ "$what" = algos ]; then
  # DPO, RM and PPO (#19) with megatron on the GPU (bf16, policy.device=cuda; DPO's frozen
  # reference and PPO's critic there too): the CPU demos' tasks, on a random tiny Llama.
  d=$(mktemp -d)
  "$bin/rlh_tiny_model" "$d/model" --alphabet "0123456789=" --seed 5 >/dev/null || rc=1
  python3 - "$d" <<'PY'
import json, random, sys
for name, n, seed in (("train", 256, 11), ("val", 64, 12)):
    r = random.Random(seed)
    with open(f"{sys.argv[1]}/{name}.jsonl", "w") as f:
        for _ in range(n):
            p = "".join(str(r.randrange(10)) for _ in range(3))
            other = r.choice([c for c in "0123456789" if c != p[0]])
            f.write(json.dumps({"prompt": p + "=", "chosen": p[0], "rejected": other}) + "\n")
PY
  common=(--plugin megatron --plugin dataset_jsonl --plugin tokenizer_hf --plugin model_llama --plugin kernels_cpu)
  gpu=(policy.model_name="$d/model" data.train.data_path="$d/train.jsonl" data.validation.data_path="$d/val.jsonl"
       policy.dtensor_cfg.enabled=false ++policy.megatron_cfg.enabled=true ++policy.megatron_cfg.optimizer.lr=3e-3
       ++policy.megatron_cfg.optimizer.weight_decay=0 policy.precision=bfloat16 ++policy.device=cuda)
  for a in dpo rm; do
    echo "== $a on the GPU =="
    "$bin/rlhost" "${common[@]}" --plugin $a --config examples/configs/${a}_demo_cpu.yaml "${gpu[@]}" \
      checkpointing.checkpoint_dir="$d/$a" logger.log_dir="$d/$a/logs" > "$out/algos_$a.log" 2>&1 || { echo "$a failed"; rc=1; }
    grep -E "error" "$out/algos_$a.log" | cut -c1-260 | tail -3
    grep -o '"validation-default/accuracy":[0-9.e-]*' "$d/$a/logs/metrics.jsonl" | tr '\n' ' '; echo
    cp "$d/$a/logs/metrics.jsonl" "$out/algos_${a}_metrics.jsonl" 2>/dev/null
  done
  echo "== ppo on the GPU (policy and critic) =="
  "$bin/rlh_tiny_model" "$d/ppo_model" --alphabet "0123456789=" --seed 11 >/dev/null
  python3 - "$d" <<'PY'
import json, random, sys
r, seen = random.Random(777), set()
for name, n in (("ppo_train", 4096), ("ppo_val", 128)):
    with open(f"{sys.argv[1]}/{name}.jsonl", "w") as f:
        while n:
            p = "".join(str(r.randrange(10)) for _ in range(4))
            if p in seen: continue
            seen.add(p); n -= 1
            f.write(json.dumps({"input": p, "output": p[3]}) + "\n")
PY
  "$bin/rlhost" --plugin megatron --plugin generator --plugin environments --plugin dataset_jsonl --plugin tokenizer_hf \
    --plugin model_llama --plugin kernels_cpu --plugin ppo --config examples/configs/ppo_demo_cpu.yaml \
    policy.model_name="$d/ppo_model" data.train.data_path="$d/ppo_train.jsonl" data.validation.data_path="$d/ppo_val.jsonl" \
    logger.log_dir="$d/ppo/logs" policy.dtensor_cfg.enabled=false ++policy.megatron_cfg.enabled=true \
    ++policy.megatron_cfg.optimizer.lr=1e-3 ++policy.megatron_cfg.optimizer.weight_decay=0 policy.precision=bfloat16 \
    ++policy.device=cuda ++value.dtensor_cfg.enabled=false ++value.megatron_cfg.enabled=true \
    ++value.megatron_cfg.optimizer.lr=1e-2 ++value.megatron_cfg.optimizer.weight_decay=0 ++value.precision=bfloat16 \
    ${PPO_ARGS:-} > "$out/algos_ppo.log" 2>&1 || { echo "ppo failed"; rc=1; }
  grep -E "error|on cuda" "$out/algos_ppo.log" | cut -c1-260 | tail -4
  grep -o '"validation/accuracy":[0-9.e-]*' "$d/ppo/logs/metrics.jsonl" | tr '\n' ' '; echo
  cp "$d/ppo/logs/metrics.jsonl" "$out/algos_ppo_metrics.jsonl" 2>/dev/null
  echo "== multi-turn GRPO on the GPU (reveal, 2 turns) =="
  "$bin/rlh_tiny_model" "$d/reveal_model" --alphabet "0123456789=" --seed 11 >/dev/null
  python3 - "$d" <<'PY'
import json, random, sys
r = random.Random(12345)
for name, n in (("reveal_train", 4096), ("reveal_val", 128)):
    with open(f"{sys.argv[1]}/{name}.jsonl", "w") as f:
        for _ in range(n): f.write(json.dumps({"input": "=", "output": str(r.randrange(10))}) + "\n")
PY
  "$bin/rlhost" --plugin megatron --plugin generator --plugin environments --plugin dataset_jsonl --plugin tokenizer_hf \
    --plugin model_llama --plugin kernels_cpu --plugin grpo --config examples/configs/grpo_multiturn_demo_cpu.yaml \
    policy.model_name="$d/reveal_model" data.train.data_path="$d/reveal_train.jsonl" \
    data.validation.data_path="$d/reveal_val.jsonl" logger.log_dir="$d/reveal/logs" policy.dtensor_cfg.enabled=false \
    ++policy.megatron_cfg.enabled=true ++policy.megatron_cfg.optimizer.lr=1e-2 ++policy.megatron_cfg.optimizer.weight_decay=0 \
    policy.precision=bfloat16 ++policy.device=cuda > "$out/algos_multiturn.log" 2>&1 || { echo "multi-turn failed"; rc=1; }
  grep -E "error" "$out/algos_multiturn.log" | cut -c1-260 | tail -3
  grep -o '"validation/accuracy":[0-9.e-]*' "$d/reveal/logs/metrics.jsonl" | tr '\n' ' '; echo
  cp "$d/reveal/logs/metrics.jsonl" "$out/algos_multiturn_metrics.jsonl" 2>/dev/null
fi
if [ "$what" = fusedlayer ]; then
  # decode_layer_fwd (kernels_cuda's persistent one-token layer, 2026-12-06 nineteenth session):
  # its generator test (against the op-by-op steps, graphs, refit) and the fixture greedy test,
  # check-kernels' row for it, in each of its forms (FUSED_TILES: tiles claimed, the default, or
  # dealt, RLH_KCUDA_DL_CLAIM=0; attention chunks down to 64 positions, RLH_KCUDA_DL_MIN_CHUNK=64;
  # the counted barrier, RLH_KCUDA_DL_BARRIER=count), then batch-1 decoding with each and without
  # it (opt-in: RLH_GEN_FUSED_LAYER=1) in one call, then where its time goes (phase stamps).
  forms=${FUSED_TILES:-RLH_KCUDA_DL_CLAIM=1 RLH_KCUDA_DL_CLAIM=0 RLH_KCUDA_DL_MIN_CHUNK=64,RLH_KCUDA_DL_BARRIER=count}
  for v in $forms; do
    echo "== test_generator_cuda (fused layer, fixtures) with $v =="
    env ${v//,/ } "$bin/test_generator_cuda" --gtest_brief=1 --gtest_filter='*FusedLayer*:GpuFixture.*' 2>&1 | tee -a "$out/fusedlayer_test.log" |
      grep -E "^\[  (PASSED|FAILED|SKIPPED) |decode_layer|fused|Failure|rror|Which is|Expected|actual" | head -40
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    echo "== rlhost check-kernels --plugin libkernels_cuda.so (decode_layer_fwd) with $v =="
    env ${v//,/ } "$bin/rlhost" check-kernels --plugin "$bin/plugins/libkernels_cuda.so" --device cuda:0 > "$out/fusedlayer_check.log" 2>&1
    ck=$?
    grep -E "^(op |decode_layer|FAIL)|error" "$out/fusedlayer_check.log" | head -12
    [ "$ck" = 0 ] || rc=1
  done
  for v in ${FUSED_VARIANTS:-DEFAULT=1 $(for f in $forms RLH_KCUDA_DL_MIN_CHUNK=64 RLH_KCUDA_DL_BARRIER=count; do echo RLH_GEN_FUSED_LAYER=1,$f; done)}; do
    for c in ${FUSED_CASES:-b1}; do
      echo "== bench_generator_cuda $c with $v =="
      env ${v//,/ } "$bin/bench_generator_cuda" --shape llama1b --case "$c" --prompt 128 --new 256 --repeats 2 2>&1 |
        tee -a "$out/fusedlayer_bench.log" | grep -E "^RESULT|rror" | cut -c1-200
    done
  done
  # Where the fused layer's time goes: its per-phase stamps (RLH_KCUDA_DL_TRACE, op by op so the
  # host can read them), then ncu's time, DRAM and stall figures for a few launches.
  for v in $forms; do
    echo "== RLH_KCUDA_DL_TRACE: phase stamps at b1 with $v =="
    env ${v//,/ } RLH_GEN_FUSED_LAYER=1 RLH_KCUDA_DL_TRACE=1 "$bin/bench_generator_cuda" --shape llama1b --case b1 --prompt 128 \
      --new 64 --repeats 1 --no-graphs 2>&1 | grep "trace" > "$out/fusedlayer_trace_${v//[=,]/_}.log"
    tail -3 "$out/fusedlayer_trace_${v//[=,]/_}.log" | cut -c1-400
  done
  if [ "${FUSED_NCU:-1}" != 0 ]; then
    echo "== ncu: decode_layer_kernel, 3 launches =="
    RLH_GEN_FUSED_LAYER=1 timeout 150 ncu --clock-control none --kernel-name regex:decode_layer --launch-skip 40 --launch-count 3 \
      --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_sleeping_per_warp_active.pct,smsp__warp_issue_stalled_wait_per_warp_active.pct,smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct \
      "$bin/bench_generator_cuda" --shape llama1b --case b1 --prompt 128 --new 16 --repeats 1 --no-graphs > "$out/fusedlayer_ncu.log" 2>&1
    grep -E "^    [a-z]|decode_layer_kernel" "$out/fusedlayer_ncu.log" | tail -10
  fi
fi
if [ "$what" = decodeab ]; then
  # The batch-1 decoding changes of 2026-12-06, each against its absence in the same call: the
  # fused residual add + norm and gate|up with its GLU (add_rmsnorm_fwd, gemm_glu_fwd, each
  # withheld by RLH_KCUDA_WITHHOLD), programmatic
  # dependent launch (RLH_KCUDA_PDL=0), gemv's first round of weights loaded before the wait
  # (RLH_KCUDA_GEMV_PRELOAD=0: only prefetched into L2), the few-row gemm for gate|up (RLH_KCUDA_GEMV_MAX at the old
  # 32 Mi), whole rows in the tensor-core paged attention at small batch (RLH_KCUDA_PAGED_MIN_TILES=8: off by default since it lost;
  # default splits); then the kernel tests that hold them to the unfused bits.
  echo "== test_cuda_kernels (add_rmsnorm_fwd bitwise, few-row gemm) =="
  "$bin/test_cuda_kernels" --gtest_brief=1 --gtest_filter='CudaElementwise.AddRmsnorm*:CudaGemm.*' 2>&1 |
    tee "$out/decodeab_kernels.log" | grep -E "^\[  (PASSED|FAILED)|Failure|gemm bf16.*tb=1 [1-4]x" | head -20
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  # DECODEAB_VARIANTS picks the variants (ALL=1: everything on).
  # A variant may set several variables, comma-separated; DECODEAB_CASES="b1 b64" (default b1).
  for c in ${DECODEAB_CASES:-b1}; do
    for v in ${DECODEAB_VARIANTS:-ALL=1 RLH_KCUDA_WITHHOLD=add_rmsnorm_fwd RLH_KCUDA_WITHHOLD=gemm_glu_fwd RLH_KCUDA_PDL=0 RLH_KCUDA_GEMV_PRELOAD=0 RLH_KCUDA_GEMV_MAX=33554432 RLH_KCUDA_PAGED_MIN_TILES=8}; do
      echo "== bench_generator_cuda $c with $v =="
      env ${v//,/ } "$bin/bench_generator_cuda" --shape llama1b --case "$c" --prompt 128 --new 256 --repeats 2 2>&1 |
        tee -a "$out/decodeab_bench.log" | grep -E "^$c |rror" | cut -c1-120
    done
  done
  # Where a graph-replayed batch-1 step's time goes, kernel by kernel inside the graphs (ncu
  # serialises kernels and adds microseconds to each; nsys traces the graphs' nodes as they run).
  if command -v nsys > /dev/null; then
    echo "== nsys: b1, kernels inside the decoding graphs =="
    nsys profile -t cuda --cuda-graph-trace=node -o "$out/b1_trace" --force-overwrite true \
      "$bin/bench_generator_cuda" --shape llama1b --case b1 --prompt 128 --new 256 --repeats 1 > /dev/null 2>&1
    nsys stats --report cuda_gpu_kern_sum --format csv "$out/b1_trace.nsys-rep" 2> /dev/null |
      tee "$out/b1_kernels.csv" | cut -d, -f1-6,9 | head -30
    rm -f "$out/b1_trace.nsys-rep" "$out/b1_trace.sqlite"
  fi
fi
if [ "$what" = dp ]; then
  # Only the data-parallel device tests (DDP, the distributed optimizer, FSDP and, at 4 ranks,
  # HSDP) over comm_mpi on this GPU: the quick part of the mpi stage.
  source "$bin/openmpi/env.sh"
  for np in ${DP_RANKS:-2 4}; do
    echo "== mpirun -np $np test_backend_cuda_dp =="
    mpirun -np "$np" "$bin/test_backend_cuda_dp" --gtest_brief=1 --gtest_filter="${DP_FILTER:-*}" 2>&1 | tee "$out/test_backend_cuda_dp_np$np.log" |
      grep -E "^\[  (PASSED|FAILED|SKIPPED) |device dp|fsdp|Failure|rror|Which is|Expected|actual" | head -60
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
fi
if [ "$what" = mpi ]; then
  # Several ranks on this one GPU (#17): OpenMPI carried in $bin/openmpi (scripts/pack_openmpi.sh),
  # comm_mpi staging the device collectives through the host (NCCL refuses two ranks on one GPU).
  # test_backend_cuda_dp (DDP and the distributed optimizer on the CUDA engine against one rank,
  # checkpoints), then GRPO's demo with megatron, the policy and the generator on the GPU at DP=2
  # beside one rank.
  source "$bin/openmpi/env.sh"
  echo "== mpirun -np 2 test_backend_cuda_dp =="
  mpirun -np 2 "$bin/test_backend_cuda_dp" 2>&1 | tee "$out/test_backend_cuda_dp.log" |
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |device dp|Failure|rror|Which is|Expected|actual" | head -60
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  d=$(mktemp -d)
  "$bin/rlh_tiny_model" "$d/tiny" --alphabet "0123456789+-*=" --seed 1 >/dev/null || rc=1
  grpo=(--plugin environments --plugin tokenizer_hf --plugin model_llama --plugin kernels_cpu --plugin megatron
        --plugin generator --plugin grpo --config examples/configs/grpo_demo_cpu.yaml policy.model_name="$d/tiny"
        grpo.max_num_steps=${MPI_STEPS:-30} grpo.val_period=10 policy.dtensor_cfg.enabled=false
        ++policy.megatron_cfg.enabled=true ++policy.megatron_cfg.optimizer.lr=1e-3
        ++policy.megatron_cfg.optimizer.weight_decay=0 ++policy.megatron_cfg.optimizer.use_distributed_optimizer=true
        policy.precision=bfloat16 ++policy.device=cuda ++rlhost.comm_timeout_s=60)
  for np in 1 2; do
    echo "== GRPO demo on the GPU, $np rank(s) =="
    t0=$(date +%s)
    # A KV cache of a fixed size per rank: gpu_memory_utilization counts the memory in use on the
    # whole device, so with ranks sharing the GPU the first generator's pool leaves the next none.
    mpirun -np $np "$bin/rlhost" "${grpo[@]}" checkpointing.checkpoint_dir="$d/np$np" logger.log_dir="$d/np$np/logs" \
      ++policy.generation.native_cfg.kv_cache_bytes=4294967296 \
      > "$out/mpi_grpo_np$np.log" 2>&1 || { echo "GRPO at $np rank(s) failed"; rc=1; }
    echo "took $(( $(date +%s) - t0 )) s"
    grep -E "data parallel|communicator|error" "$out/mpi_grpo_np$np.log" | cut -c1-300 | head -4
    grep -o '"validation/accuracy":[0-9.e-]*' "$d/np$np/logs/metrics.jsonl" | tr '\n' ' '; echo
    cp "$d/np$np/logs/metrics.jsonl" "$out/mpi_grpo_np${np}_metrics.jsonl" 2>/dev/null
  done
fi
if [ "$what" = genprofile ]; then
  # Where a decoding step's time goes: the generator benchmark alone (no HF peer: a quick look,
  # not a result), then Nsight Compute's per-kernel durations over a few decoding steps, op by op
  # (graphs off; the kernels are the same). Clocks left alone (METHOD.md).
  #   GENPROF_CASES="b1:2500 b256:4500"  case:launches skipped (past the prefill)
  #   GENPROF_FP8="0 1 2"                bf16 weights, FP8 rollouts (the vendor's plugin), and those with the FP8 KV cache
  #   GENPROF_BENCH=0                    without the benchmark first
  if [ "${GENPROF_BENCH:-1}" != 0 ]; then
    echo "== bench_generator_cuda (alone) =="
    "$bin/bench_generator_cuda" --shape llama1b --case all --prompt 128 --new 256 --repeats 2 2>&1 | tee "$out/genbench_alone.log" | grep -v "^RESULT"
  fi
  for f in ${GENPROF_FP8:-0}; do
    for c in ${GENPROF_CASES:-b1:2500 b256:4500}; do
      name=${c%%:*} skip=${c##*:} flag=
      [ "$f" = 1 ] && flag=--fp8 && name=${name}_fp8
      [ "$f" = 2 ] && flag="--fp8 --kv-fp8" && name=${name}_fp8kv
      echo "== ncu: ${c%%:*} ${flag}, ~3 decoding steps =="
      RLH_TEST_PLUGIN_DIR=$fp8_plugins timeout "${NCU_TIMEOUT:-200}" ncu --clock-control none --metrics gpu__time_duration.sum \
        --csv --launch-skip "$skip" --launch-count 700 "$bin/bench_generator_cuda" --shape llama1b \
        --case "${c%%:*}" --prompt 128 --new 32 --repeats 1 --no-graphs $flag > "$out/ncu_$name.csv" 2>&1
      python3 - "$out/ncu_$name.csv" <<'PY'
import collections, csv, sys
# One row per launch (ncu --csv: kernel name in column 4, duration in ns in column 14); total per kernel.
tot, cnt = collections.defaultdict(float), collections.Counter()
for r in csv.reader(open(sys.argv[1], errors="replace")):
    if len(r) == 15 and r[0].isdigit():
        tot[r[4][:100]] += float(r[14].replace(",", "")) / 1e3
        cnt[r[4][:100]] += 1
all_us = sum(tot.values()) or 1
for k, t in sorted(tot.items(), key=lambda x: -x[1])[:24]:
    print(f"{t:9.1f} us {100 * t / all_us:5.1f}%  {t / cnt[k]:8.2f} us x {cnt[k]:4}  {k}")
print(f"{all_us:9.1f} us in all, {sum(cnt.values())} launches")
PY
    done
  done
fi
if [ "$what" = ncukernel ]; then
  # One kernel of a decoding run under Nsight Compute's sections (where its time goes: memory
  # throughput, warp stalls, occupancy), caches flushed before it as in a decoding step where the
  # weights were last read a step ago. NCUK_REGEX (kernel name), NCUK_VARIANT (fp8prod's
  # variants), NCUK_CASE (b64), NCUK_SKIP / NCUK_COUNT (matching launches skipped / profiled).
  fp8_variant "${NCUK_VARIANT:-fp8-few64}"
  env $e RLH_TEST_PLUGIN_DIR=$fp8_plugins timeout "${NCU_TIMEOUT:-200}" ncu --clock-control none \
    -k "regex:${NCUK_REGEX:-few_rows_kernel}" --launch-skip "${NCUK_SKIP:-64}" --launch-count "${NCUK_COUNT:-4}" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
    --section Occupancy --section SchedulerStats "$bin/bench_generator_cuda" --shape llama1b \
    --case "${NCUK_CASE:-b64}" --prompt 128 --new 16 --repeats 1 --no-graphs $f > "$out/ncukernel.log" 2>&1 || rc=1
  grep -E "few_rows|nvjet|Duration|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Grid Size|Cluster|Stall|Warp Cycles Per Issued|No Eligible|Active Warps|Waves" \
    "$out/ncukernel.log" | head -120
fi
if [ "$what" = l2prefetch ]; then
  # bench/kernels_cuda/bench_l2_prefetch.cu: a weight warmed in L2 while HBM idles, against cold.
  "$bin/bench_l2_prefetch" --reps "${L2_REPS:-30}" 2>&1 | tee "$out/l2prefetch.log" | sed 's/RESULT name=l2_prefetch //'
fi
if [ "$what" = pagedmma ]; then
  # paged_attention's tensor-core kernel (the default since this stage first passed, 2026-12-05;
  # forced on here): the decode tests, the generator's GPU tests and check-kernels with it on, then the
  # generator benchmark with the SIMT kernel and with it, in the same run.
  for t in test_cuda_decode test_generator_cuda; do
    echo "== $t (RLH_KCUDA_PAGED_MMA=1) =="
    RLH_KCUDA_PAGED_MMA=1 "$bin/$t" --gtest_brief=1 > "$out/mma_$t.log" 2>&1 || rc=1
    grep -E "^\[  (PASSED|FAILED) |Failure|dlp" "$out/mma_$t.log" | head -30
  done
  echo "== rlhost check-kernels --op paged_attention (RLH_KCUDA_PAGED_MMA=1) =="
  RLH_KCUDA_PAGED_MMA=1 "$bin/rlhost" check-kernels --plugin "$bin/plugins/libkernels_cuda.so" --device cuda:0 \
    --op paged_attention > "$out/mma_check_kernels.log" 2>&1 || rc=1
  grep -E "^(op |FAIL|paged)|error" "$out/mma_check_kernels.log" | head -20
  for m in 0 1; do
    echo "== bench_generator_cuda, RLH_KCUDA_PAGED_MMA=$m =="
    RLH_KCUDA_PAGED_MMA=$m "$bin/bench_generator_cuda" --shape llama1b --case all --prompt 128 --new 256 --repeats 2 \
      > "$out/mma_bench_$m.log" 2>&1 || rc=1
    grep -E "^RESULT|rror" "$out/mma_bench_$m.log"
  done
fi
if [ "$what" = fp8profile ]; then
  # Where an FP8 training step's time goes, beside bf16's: Nsight Compute's per-kernel times of
  # one 1B step (the first: it carries one-time casts), by kind (bench/engine_cuda/ncu_breakdown.py).
  for r in ${FP8_PROFILE:-none blockwise}; do
    echo "== ncu: bench_cuda_engine --shape llama1b --fp8 $r, one step =="
    RLH_TEST_PLUGIN_DIR=$fp8_plugins timeout "${NCU_TIMEOUT:-120}" ncu --metrics gpu__time_duration.sum --csv \
      "$bin/bench_cuda_engine" --shape llama1b --only train --steps 1 --warmup 0 --fp8 "$r" > "$out/ncu_fp8_$r.csv" 2>&1 || rc=1
    python3 bench/engine_cuda/ncu_breakdown.py "$out/ncu_fp8_$r.csv" | tee "$out/ncu_fp8_$r.txt"
  done
fi
if [ "$what" = parity ]; then
  # #16's train-generation parity: the deterministic mode bitwise (the generator against the CUDA
  # engine's batch-invariant forward, every test model and fixture), the sample op's given ids
  # against kernels_cpu, then the mismatch at the 1B shape in the default and deterministic modes.
  echo "== test_generator_cuda *GpuDeterministic* =="
  "$bin/test_generator_cuda" --gtest_brief=1 --gtest_filter='*GpuDeterministic*' 2>&1 | tee "$out/parity_tests.log" |
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |mode:|Failure|rror|Which is|Expected|actual" | head -80
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  echo "== test_cuda_decode =="
  "$bin/test_cuda_decode" --gtest_brief=1 2>&1 | tee "$out/test_cuda_decode.log" | grep -E "^\[  (PASSED|FAILED)|Failure" | head
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  "$bin/rlhost" check-kernels --plugin "$bin/plugins/libkernels_cuda.so" --device cuda:0 > "$out/check_kernels.log" 2>&1 || rc=1
  grep -E "^(sample|FAIL)|kernels_cuda on" "$out/check_kernels.log" | head
  for mode in "" "--deterministic"; do
    echo "== bench_generator_cuda --parity ${mode:-(default mode)} =="
    "$bin/bench_generator_cuda" --shape llama1b --case "${PARITY_CASES:-b64}" --prompt 128 --new 256 --repeats 1 --parity $mode 2>&1 |
      tee -a "$out/parity_bench.log" | grep -E "^(b1|b64|b256|grpo) |PARITY|rror" | cut -c1-200
  done
fi
if [ "$what" = parityab ]; then
  # Where the default mode's mismatch comes from at the 1B shape: the generator in its default
  # mode against the trainer with each deterministic part alone (bench_generator_cuda --trainer),
  # and the deterministic generator against the default trainer.
  for v in "--trainer none" "--trainer all" "--trainer attention" "--trainer attention+head" "--trainer gemm+head" \
           "--deterministic --trainer none"; do
    echo "== bench_generator_cuda --parity $v =="
    "$bin/bench_generator_cuda" --shape llama1b --case "${PARITY_CASES:-b64}" --prompt 128 --new 256 --repeats 1 --parity $v 2>&1 |
      tee -a "$out/parityab.log" | grep -E "^(b1|b64|b256|grpo) |PARITY|trainer for|rror" | cut -c1-160
  done
fi
if [ "$what" = grpostep ]; then
  # The whole 1B GRPO step (policy, reference and generator on this GPU) beside torch_grpo_step.py.
  OUT=$out/grpostep bench/grpo_cuda/run.sh "$bin" 2>&1 | tee "$out/grpostep.log" | tail -16
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  rm -rf "$out/grpostep/model"  # the 2.5 GB checkpoint: $OUT brings back logs only
fi
if [ "$what" = genbench ] || [ "$what" = all ]; then
  RESULT_JSON=$out/generator.json bench/generator_cuda/run.sh "$bin/bench_generator_cuda" 2>&1 | tee "$out/genbench.log" | tail -30
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  RESULT_JSON=$out/engine.json bench/engine_cuda/run.sh "$bin/bench_cuda_engine" 2>&1 | tee "$out/bench.log" | tail -40
fi
exit $rc
