#!/usr/bin/env bash
# usage: out_of_tree.sh BUILD_DIR EXAMPLE_SRC WORK_DIR CXX
set -euo pipefail
build=$1 example=$2 work=$3 cxx=$4
rm -rf "$work" && mkdir -p "$work"
# Each step's output goes to a log, printed when a step fails (it once failed under ctest -j2 with
# nothing to show why).
log="$work/steps.log"
trap 'rc=$?; [ $rc = 0 ] || { echo "failed (exit $rc); the last output:"; tail -40 "$log"; }' EXIT
cmake --install "$build" --prefix "$work/prefix" >>"$log" 2>&1
test -x "$work/prefix/bin/rlhost" || { echo "installed rlhost missing"; exit 1; }
test -f "$work/prefix/lib/cmake/rlsdk/rlsdkConfig.cmake" || { echo "rlsdkConfig.cmake missing"; exit 1; }
# A sanitizer build's plugins need the sanitizer flags too.
extra=()
case "${RLH_TEST_SANITIZE:-}" in 1) extra=(-DCMAKE_CXX_FLAGS="-fsanitize=address,undefined" -DCMAKE_MODULE_LINKER_FLAGS="-fsanitize=address,undefined");; esac
cmake -G Ninja -S "$example" -B "$work/example" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_CXX_COMPILER="$cxx" "${extra[@]}" >>"$log" 2>&1
cmake --build "$work/example" >>"$log" 2>&1
so="$work/example/libkeyword_env.so"
test -f "$so" || { echo "plugin not built"; exit 1; }
# Exactly one exported symbol.
exports=$(nm -D --defined-only "$so" | awk '{print $3}' | grep -v '^_' || true)
[ "$exports" = "rlh_plugin_entry" ] || { echo "unexpected exports: $exports"; exit 1; }
out=$(RLHOST_PLUGIN_PATH= "$work/prefix/bin/rlhost" --plugin "$so" --list-plugins --json 2>>"$log")
grep -q '"name": "keyword"' <<<"$out" || { echo "component not listed: $out"; exit 1; }
grep -q '"can_run": true' <<<"$out" || { echo "not runnable: $out"; exit 1; }
grep -q '"loaded": true' <<<"$out" || { echo "not loaded: $out"; exit 1; }
echo "out-of-tree plugin built against the installed SDK and loaded by the installed rlhost"
