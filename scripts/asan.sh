#!/usr/bin/env bash
# `make asan`: the native extension built with AddressSanitizer + UndefinedBehaviorSanitizer into
# build/native-asan (the normal build in build/native and the installed module are not touched),
# then the native tests, a replay of the fuzz corpus and a 2-rank generate run with it loaded.
#
# A sanitized extension inside an uninstrumented Python needs the sanitizer runtimes loaded first,
# so every command runs with:
#   LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
#   ASAN_OPTIONS=detect_leaks=0    CPython leaks its interned objects and arenas on purpose at exit
#   PIPEINFER_NATIVE_DIR=build/native-asan   pipeinfer_cli imports _native from there first
# Reports go to build/asan/ (log_path); any report, or a failing step, fails the target.
# ggml and llama.cpp come prebuilt from the llama-cpp-python wheel and are not instrumented: only
# pipeinfer's C++ (native/src) is checked, including every call it makes into them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BUILD=build/native-asan
REPORTS=$PWD/build/asan
SAN_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"

cmake -S native -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython_EXECUTABLE="$PWD/$PY" \
  -DCMAKE_CXX_FLAGS="$SAN_FLAGS" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DCMAKE_PREFIX_PATH="$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])');$($PY -m pybind11 --cmakedir)" > /dev/null
cmake --build "$BUILD" --parallel 2   # no install step: that would replace src/pipeinfer_cli/_native*.so

rm -rf "$REPORTS" && mkdir -p "$REPORTS"
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$REPORTS/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$REPORTS/ubsan"
export PIPEINFER_NATIVE_DIR="$PWD/$BUILD"

$PY -c "import pipeinfer_cli._native as n, sys; assert n.__file__.startswith(sys.argv[1]), n.__file__; print('sanitized module:', n.__file__)" "$PWD/$BUILD"
$PY -m pytest -q -p no:cacheprovider tests/test_native_engine.py tests/test_native_errors.py tests/test_native_kv.py \
  tests/test_native_tree.py tests/test_native_cancel.py tests/test_native_moe.py tests/test_native_parity_qwen3.py \
  tests/test_native_batch_invariance.py tests/test_fuzz_replay.py
.venv/bin/pipeinfer generate smollm2-135m-instruct --ranks 2 --draft lookup --mode pipeinfer -n 24 \
  -p "The three primary colours are" > "$REPORTS/generate.out"
echo "2-rank generate under ASan/UBSan: $(wc -c < "$REPORTS/generate.out") bytes of text"

if compgen -G "$REPORTS/[au][sb]san.*" > /dev/null; then
  echo "sanitizer reports:" >&2
  cat "$REPORTS"/[au][sb]san.* >&2
  exit 1
fi
echo "make asan: no AddressSanitizer or UndefinedBehaviorSanitizer reports"
