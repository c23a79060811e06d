#!/bin/bash
# Builds the native module with AddressSanitizer + UndefinedBehaviorSanitizer in a scratch folder and runs the
# tests that drive native code against it (the installed module is left alone).
#   bash scripts/asan_check.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
build=$(mktemp -d /tmp/tiergram-asan.XXXXXX)
trap 'rm -rf "$build"' EXIT
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython_EXECUTABLE="$(command -v python)" \
    -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags" > "$build/cmake.log"
cmake --build "$build" -j "$(nproc)" > "$build/build.log" 2>&1
so=$(ls "$build"/_native*.so)

# The interpreter is not built with ASan: preload the runtimes, and load the sanitized module as
# tiergram._native before tiergram imports it.
cat > "$build/asan_native.py" <<EOF
import importlib.util, sys
spec = importlib.util.spec_from_file_location("tiergram._native", "$so")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
sys.modules["tiergram._native"] = mod
EOF
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export PYTHONPATH="$build${PYTHONPATH:+:$PYTHONPATH}"
python - <<'EOF'
import asan_native, tiergram, tiergram._native as n
assert n.__file__.startswith(asan_native.spec.origin.rsplit("/", 1)[0]), n.__file__
print("sanitized module:", n.__file__)
EOF
python -m pytest -q -p asan_native -p no:cacheprovider -x \
    tests/test_native_cache.py tests/test_native_crc.py tests/test_native_pool.py tests/test_page_reader.py \
    tests/test_store.py tests/test_store_file.py tests/test_host_huge.py tests/test_host_memory.py tests/test_cache.py \
    tests/test_codecs.py tests/test_engine.py "$@"
