#!/bin/sh
# Build llama.cpp's RPC backend and the clients that use it, from the llama.cpp tree that the
# llama-cpp-python sdist vendors (registries only: PyPI for the source, Debian for the compiler).
#
#   scripts/build_llama_rpc.sh [OUT]        (default OUT: build/llama-rpc; `make llama-rpc` runs it)
#
# OUT receives, statically linked (no shared ggml/llama next to them):
#   rpc-server          ggml-rpc-server: exposes this host's CPU as a ggml device over TCP
#   llama-completion    the classic one-shot CLI (greedy text + llama_perf timings), takes --rpc
#   llama-speculative   speculative decoding with a draft model (-md), takes --rpc
#   build-info.txt      version, the CMake flags, the CPU features compiled in
# The sdist is kept in OUT/src, the CMake tree in OUT/cmake. A second run with the same version
# and flags does nothing (OUT/.stamp records them).
#
# CPU features: GGML_NATIVE=OFF, then each of AVX, AVX2, FMA, F16C, BMI2, AVX512(F), AVX512_VBMI,
# AVX512_VNNI, AVX512_BF16, AVX_VNNI that /proc/cpuinfo reports. AMX is never compiled in: some
# Xeons of this kind advertise AMX and die with SIGILL on it. Override with LLAMA_RPC_CPU_FLAGS
# (e.g. "-DGGML_AVX2=ON -DGGML_FMA=ON ...") to build for another CPU.
#
# Environment: PYTHON (for pip; default .venv/bin/python, else python3), LLAMA_CPP_PYTHON_VERSION
# (default: the pin in pyproject.toml), CMAKE_BUILD_PARALLEL_LEVEL (default: nproc).
set -eu

root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/build/llama-rpc}
mkdir -p "$out"
out=$(cd "$out" && pwd)

version=${LLAMA_CPP_PYTHON_VERSION:-$(sed -n 's/.*"llama-cpp-python==\([^"]*\)".*/\1/p' "$root/pyproject.toml" | head -n 1)}
[ -n "$version" ] || { echo "build_llama_rpc: no llama-cpp-python pin in pyproject.toml" >&2; exit 1; }
python=${PYTHON:-$root/.venv/bin/python}
[ -x "$python" ] || python=python3

# /proc/cpuinfo flag -> GGML option. AMX (amx_tile, amx_int8, amx_bf16) deliberately absent.
cpu_flags() {
    flags=" $(grep -m 1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    set -- avx:GGML_AVX avx2:GGML_AVX2 fma:GGML_FMA f16c:GGML_F16C bmi2:GGML_BMI2 \
           avx512f:GGML_AVX512 avx512vbmi:GGML_AVX512_VBMI avx512_vnni:GGML_AVX512_VNNI \
           avx512_bf16:GGML_AVX512_BF16 avx_vnni:GGML_AVX_VNNI
    for pair; do
        case $flags in
            *" ${pair%%:*} "*) printf ' -D%s=ON' "${pair#*:}" ;;
            *) printf ' -D%s=OFF' "${pair#*:}" ;;
        esac
    done
}
cpu=${LLAMA_RPC_CPU_FLAGS:-$(cpu_flags)}
cmake_flags="-DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DBUILD_SHARED_LIBS=OFF \
-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
-DLLAMA_BUILD_APP=OFF$cpu"
targets="ggml-rpc-server llama-completion llama-speculative"
stamp="llama-cpp-python $version | $cmake_flags | $targets"

if [ -f "$out/.stamp" ] && [ "$(cat "$out/.stamp")" = "$stamp" ] \
        && [ -x "$out/rpc-server" ] && [ -x "$out/llama-completion" ] && [ -x "$out/llama-speculative" ]; then
    touch "$out/.stamp"  # for make: newer than the script and pyproject.toml
    echo "llama-rpc: up to date in $out (llama.cpp of llama-cpp-python $version)"
    exit 0
fi

# 1. the source: the sdist from PyPI (pip checks its hash), unpacked once
sdist=$out/src/llama_cpp_python-$version.tar.gz
if [ ! -f "$sdist" ]; then
    mkdir -p "$out/src"
    echo "llama-rpc: downloading the llama-cpp-python $version sdist from PyPI"
    "$python" -m pip download --quiet --no-binary :all: --no-deps --dest "$out/src" "llama-cpp-python==$version"
fi
tree=$out/src/llama_cpp_python-$version/vendor/llama.cpp
if [ ! -f "$tree/CMakeLists.txt" ]; then
    tar -xzf "$sdist" -C "$out/src"
fi

# 2. configure and build (the CMake tree is reused: a changed flag rebuilds only what it touches)
echo "llama-rpc: building $targets with$cpu"
# shellcheck disable=SC2086  # the flags are words
cmake -S "$tree" -B "$out/cmake" $cmake_flags > "$out/cmake-configure.log" 2>&1 \
    || { tail -n 30 "$out/cmake-configure.log" >&2; exit 1; }
# shellcheck disable=SC2086
cmake --build "$out/cmake" --parallel "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" --target $targets

# 3. the binaries, under the names the docs and benchmarks/rpc.py use
install -m 755 "$out/cmake/bin/ggml-rpc-server" "$out/rpc-server"
install -m 755 "$out/cmake/bin/llama-completion" "$out/llama-completion"
install -m 755 "$out/cmake/bin/llama-speculative" "$out/llama-speculative"
{
    echo "llama.cpp vendored by llama-cpp-python $version"
    grep -m 1 'LLAMA_BUILD_NUMBER\|BUILD_COMMIT' "$out/cmake/common/build-info.cpp" 2>/dev/null || true
    echo "cmake $cmake_flags"
    echo "targets $targets"
} > "$out/build-info.txt"
echo "$stamp" > "$out/.stamp"
echo "llama-rpc: rpc-server, llama-completion, llama-speculative in $out"
