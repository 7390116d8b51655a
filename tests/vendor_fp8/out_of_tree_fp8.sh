#!/usr/bin/env bash
# The vendor's view of the FP8 plugin (examples/vendor_fp8), on any machine:
#   install rlhost, build the example out of tree against the installed SDK (find_package(rlsdk)),
#   check it exports one symbol, load it with the installed rlhost (--list-plugins), run
#   check-kernels on it (on a machine without a usable GPU: refused with the reason, exit 1), and
#   check that loading it lets policy.megatron_cfg.fp8_cfg.enabled = true and
#   policy.generation.vllm_cfg.precision = fp8 past the host's check.
# usage: out_of_tree_fp8.sh BUILD_DIR EXAMPLE_SRC WORK_DIR CXX
# The CUDA ops are built where nvcc and CUDA 12.9+ are found (VENDOR_FP8_CUDA=OFF in the
# environment leaves them out); without them the plugin still builds, loads and lists its ops.
set -euo pipefail
build=$1 example=$2 work=$3 cxx=$4
fail() { echo "out_of_tree_fp8: $*" >&2; exit 1; }
rm -rf "$work/prefix" && mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" >/dev/null
rlhost=$work/prefix/bin/rlhost
test -x "$rlhost" || fail "installed rlhost missing"
extra=()
case "${RLH_TEST_SANITIZE:-}" in 1) extra+=(-DCMAKE_CXX_FLAGS="-fsanitize=address,undefined" -DCMAKE_MODULE_LINKER_FLAGS="-fsanitize=address,undefined");; esac
[ "${VENDOR_FP8_CUDA:-ON}" = OFF ] && extra+=(-DVENDOR_FP8_CUDA=OFF)
# ccache for nvcc and the compiler, where there is one (the example's own build has no launcher).
if command -v ccache >/dev/null; then
  extra+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
cmake -G Ninja -S "$example" -B "$work/example" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo "${extra[@]}" > "$work/configure.log" || { cat "$work/configure.log"; fail "configure failed"; }
cmake --build "$work/example" > "$work/build.log" 2>&1 || { tail -30 "$work/build.log"; fail "build failed"; }
grep -E "^-- vendor_fp8:" "$work/configure.log" || true
so=$work/example/libvendor_fp8.so
test -f "$so" || fail "plugin not built"
exports=$(nm -D --defined-only "$so" | awk '{print $3}' | grep -v '^_' || true)
[ "$exports" = "rlh_plugin_entry" ] || fail "unexpected exports: $exports"
# No CUDA library is a load-time dependency (the runtime is static, cuBLASLt opened at create()).
if readelf -d "$so" | grep -E "NEEDED.*lib(cudart|cublas)" ; then fail "links a CUDA library dynamically"; fi

out=$(RLHOST_PLUGIN_PATH= "$rlhost" --plugin "$so" --list-plugins --json)
grep -q '"name": "vendor_fp8"' <<<"$out" || fail "component not listed: $out"
grep -q '"loaded": true' <<<"$out" || fail "not loaded: $out"
table=$(RLHOST_PLUGIN_PATH= "$rlhost" --plugin "$so" --list-plugins)
echo "$table" | grep -A4 "vendor_fp8 0.1.0"

# check-kernels: where it cannot run, one line saying why on every device tried, exit 1; where a
# GPU with FP8 is usable, the conformance table (the gpu tests judge it).
set +e
ck=$(RLHOST_PLUGIN_PATH="$work/prefix/lib/rlhost/plugins" "$rlhost" check-kernels --plugin "$so" 2>&1)
rc=$?
set -e
echo "$ck" | tail -4
can_run=$(echo "$out" | python3 -c 'import json, sys; print(next(p.get("can_run", False) for p in json.load(sys.stdin) if p.get("name") == "vendor_fp8"))')
if [ "$can_run" = True ]; then
  grep -q "^vendor_fp8 on cuda:0" <<<"$ck" || fail "a usable GPU, but no conformance table: $ck"
else
  [ $rc = 1 ] || fail "check-kernels exited $rc where the plugin cannot run"
  [ "$(echo "$ck" | wc -l)" = 1 ] || fail "not one line: $ck"
  # Why, per device: CUDA only (or built without CUDA) on the CPU, no usable GPU on cuda:0.
  grep -Eq "vendor_fp8 runs on none of the devices tried: cpu \(vendor_fp8 .+\); cuda:0 \(vendor_fp8.+\)$" <<<"$ck" ||
    fail "no reason given: $ck"
fi

# FP8 training settings: refused at start without the plugin, past the host's check with it.
cfg=$example/../configs/grpo_math_1B.yaml
set +e
no=$(RLHOST_PLUGIN_PATH= "$rlhost" --plugin "$work/prefix/lib/rlhost/plugins/libmegatron.so" --check-config \
  --config "$cfg" ++policy.megatron_cfg.fp8_cfg.enabled=true 2>&1 >/dev/null)
rc_no=$?
yes=$(RLHOST_PLUGIN_PATH= "$rlhost" --plugin "$work/prefix/lib/rlhost/plugins/libmegatron.so" --plugin "$so" \
  --check-config --config "$cfg" ++policy.megatron_cfg.fp8_cfg.enabled=true 2>&1 >/dev/null)
rc_yes=$?
set -e
[ $rc_no = 1 ] && grep -q "no loaded plugin claims policy.megatron_cfg.fp8_cfg" <<<"$no" ||
  fail "fp8_cfg.enabled=true without the plugin was not refused by name: $no"
[ $rc_yes = 0 ] || fail "fp8_cfg.enabled=true with the plugin loaded was refused by the host check: $yes"
# FP8 rollouts the same way (the generator reads vllm_cfg.precision).
gen=$work/prefix/lib/rlhost/plugins/libgenerator.so
set +e
no=$(RLHOST_PLUGIN_PATH= "$rlhost" --plugin "$gen" --check-config --config "$cfg" \
  ++policy.generation.vllm_cfg.precision=fp8 2>&1 >/dev/null)
rc_no=$?
yes=$(RLHOST_PLUGIN_PATH= "$rlhost" --plugin "$gen" --plugin "$so" --check-config --config "$cfg" \
  ++policy.generation.vllm_cfg.precision=fp8 2>&1 >/dev/null)
rc_yes=$?
set -e
[ $rc_no = 1 ] && grep -q "no loaded plugin claims policy.generation.vllm_cfg.precision" <<<"$no" ||
  fail "vllm_cfg.precision=fp8 without the plugin was not refused by name: $no"
[ $rc_yes = 0 ] || fail "vllm_cfg.precision=fp8 with the plugin loaded was refused by the host check: $yes"
echo "vendor_fp8 built against the installed SDK, loaded by the installed rlhost, and listed by check-kernels"
