#!/usr/bin/env bash
# A longer local fuzzing run than CI's (scripts/test.sh gives each target 10 s): builds the
# libFuzzer targets as scripts/test.sh does (build-fuzz: clang-14, ASan+UBSan), then runs each
# target ONE AT A TIME (the machine may have only 2 cores) for FUZZ_SECONDS (default 300) over a
# copy of its committed corpus, with its dictionary, and prints executions and findings per
# target. A crash, timeout (> 10 s for one input), OOM (> 2 GiB) or leak is a finding: its input
# is kept under the output folder and the target goes on fuzzing for the rest of its time.
#
#   scripts/fuzz.sh                      every target, 300 s each
#   FUZZ_SECONDS=60 scripts/fuzz.sh fuzz_math_verifier fuzz_plugin_file
#   FUZZ_OUT=/tmp/fuzz scripts/fuzz.sh   where corpora, logs and findings go (default build-fuzz/fuzz-run)
#   FUZZ_RUNS=1000000 FUZZ_SECONDS=7200 scripts/fuzz.sh
#                                        each target until it has run FUZZ_RUNS inputs (the issue's
#                                        goal: 1M each), FUZZ_SECONDS then being only a cap
#
# Exit status: 0 when no target found anything, 1 otherwise. The committed corpora are not
# changed; new inputs the run found stay in the output folder (merge them by hand if wanted).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-300}
runs=${FUZZ_RUNS:-0}
out=${FUZZ_OUT:-build-fuzz/fuzz-run}

if [ "${FUZZ_NO_BUILD:-0}" != 1 ]; then
  bash scripts/setup.sh >/dev/null
  cmake -G Ninja -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
    -DRLH_SANITIZE=ON -DRLH_FUZZ=ON -DRLH_CUDA=OFF -DRLH_BUILD_TESTS=ON >/dev/null
  cmake --build build-fuzz -j"$(nproc)" --target rlh_fuzzers
fi

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  while IFS= read -r f; do targets+=("$(basename "$f")"); done < <(find build-fuzz/tests/fuzz -maxdepth 1 -type f -name 'fuzz_*' -perm -u+x | sort)
fi

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:intercept_tls_get_addr=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
mkdir -p "$out"
summary="$out/summary.txt"
printf '%-26s %8s %12s %9s %7s %8s %5s %5s\n' target seconds executions exec/s crashes timeouts ooms leaks | tee "$summary"
status=0
for t in "${targets[@]}"; do
  bin=build-fuzz/tests/fuzz/$t
  name=${t#fuzz_}
  corpus=tests/fuzz/corpus/$name
  dict=tests/fuzz/dict/$name.dict
  # fuzz_chat_template and fuzz_jinja_filters share the Jinja dictionary.
  case "$name" in chat_template|jinja_filters) dict=tests/fuzz/dict/jinja.dict ;; esac
  [ -x "$bin" ] || { echo "$t: not built ($bin)" >&2; status=1; continue; }
  [ -d "$corpus" ] || { echo "$t: no corpus ($corpus)" >&2; status=1; continue; }
  work=$out/$t
  rm -rf "$work" && mkdir -p "$work/corpus" "$work/findings"
  cp -r "$corpus/." "$work/corpus/"
  dict_arg=()
  [ -f "$dict" ] && dict_arg=(-dict="$dict")
  execs=0 crashes=0 timeouts=0 ooms=0 leaks=0
  start=$(date +%s)
  # libFuzzer stops at its first finding; the loop restarts it (keeping the corpus it grew)
  # until the target's time is used, so one finding does not end the run.
  run=0
  while :; do
    left=$(( seconds - ($(date +%s) - start) ))
    [ "$left" -gt 0 ] || break
    runs_arg=()
    if [ "$runs" -gt 0 ]; then
      [ "$execs" -lt "$runs" ] || break
      runs_arg=(-runs=$((runs - execs)))
    fi
    run=$((run + 1))
    log=$work/run$run.log
    set +e
    # (in a subshell, so that a target killed by a signal is reported in its log, not here)
    ("$bin" -max_total_time="$left" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix="$work/findings/" "${runs_arg[@]}" "${dict_arg[@]}" "$work/corpus") >"$log" 2>&1
    rc=$?
    set -e
    # Executions: the final stats on a clean exit, else the last status line ("#N ...").
    n=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | tail -1 | grep -o '[0-9]*$' || true)
    [ -n "$n" ] || n=$(grep -o '^#[0-9]*' "$log" | tail -1 | tr -d '#' || true)
    execs=$(( execs + ${n:-0} ))
    [ "$rc" -eq 0 ] && break
    if grep -q 'ERROR: libFuzzer: timeout' "$log"; then timeouts=$((timeouts + 1))
    elif grep -q 'ERROR: libFuzzer: out-of-memory' "$log"; then ooms=$((ooms + 1))
    elif grep -q 'ERROR: LeakSanitizer' "$log"; then leaks=$((leaks + 1))
    else crashes=$((crashes + 1)); fi
    echo "  $t: finding in $log ($(ls -t "$work/findings" | head -1))" >&2
  done
  took=$(( $(date +%s) - start ))
  rate=$(( took > 0 ? execs / took : execs ))
  printf '%-26s %8d %12d %9d %7d %8d %5d %5d\n' "$t" "$took" "$execs" "$rate" "$crashes" "$timeouts" "$ooms" "$leaks" | tee -a "$summary"
  [ $((crashes + timeouts + ooms + leaks)) -eq 0 ] || status=1
done
echo "findings and logs: $out (summary: $summary)"
exit $status
