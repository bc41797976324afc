#!/usr/bin/env bash
# llama.cpp's own `llama-server` and `llama-bench`, built natively for this CPU (`make peers-llamacpp`,
# `scripts/peers.sh --llamacpp`; its header says why and where). Usage: peers_llamacpp.sh VERSION,
# VERSION being llama-cpp-python's pin: the llama.cpp source it vendors is what gets built.
#
# Steps, each skipped when its result is there:
#   1. `pip download --no-binary :all: --no-deps llama-cpp-python==VERSION`, unpacked; its
#      vendor/llama.cpp is the source (the commit it carries is recorded);
#   2. cmake with GGML_NATIVE=ON (-march=native: AVX2 / AVX-512 / AMX, whatever this CPU has),
#      only the two targets, compiled under `nice -n 19`;
#   3. a first-tokens check: `llama-bench -p 0 -n 4 -r 1` on the embedded GGUF. If it fails (the AMX
#      int8 path died with a general-protection fault on the AMX machines here with
#      llama-cpp-python's build), the source is built again with GGML_NATIVE=OFF and the
#      instruction sets named one by one, AMX off, and the fallback is recorded;
#   4. the binaries and every lib*.so* beside them in $SERVELAB_LLAMACPP_BIN, with BUILD_INFO.json:
#      version, commit, cmake flags, the CPU's flags that matter, AMX on/off/absent, the fallback.
set -euo pipefail
VERSION=${1:?usage: peers_llamacpp.sh LLAMA_CPP_PYTHON_VERSION}
cd "$(dirname "$0")/.."
HOME_DIR=$HOME/.cache/servelab-peers
BIN=${SERVELAB_LLAMACPP_BIN:-$HOME_DIR/llamacpp-bin}
SRC_ROOT=$HOME_DIR/llamacpp-src
PY=${PY:-.venv/bin/python}
PYTHON=${PYTHON:-python3}
JOBS=${SERVELAB_BUILD_JOBS:-$(nproc)}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

if [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-bench" ] && grep -q "\"llama_cpp_python\": \"$VERSION\"" "$BIN/BUILD_INFO.json" 2>/dev/null; then
  echo "[peers] ready: $BIN/llama-server, $BIN/llama-bench (llama.cpp from llama-cpp-python $VERSION; $BIN/BUILD_INFO.json)"
  exit 0
fi

# 1. the source
SRC=$SRC_ROOT/llama_cpp_python-$VERSION/vendor/llama.cpp
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  mkdir -p "$SRC_ROOT"
  echo "[peers] fetching the source of llama-cpp-python==$VERSION (it vendors llama.cpp)"
  "$PYTHON" -m pip download -q --no-binary :all: --no-deps -d "$SRC_ROOT" "llama-cpp-python==$VERSION"
  tar -xzf "$SRC_ROOT/llama_cpp_python-$VERSION.tar.gz" -C "$SRC_ROOT"
fi
COMMIT=$(git -C "$SRC" rev-parse HEAD 2>/dev/null || echo unknown)
FLAGS="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)"
has() { case " $FLAGS " in *" $1 "*) return 0 ;; esac; return 1; }
COMMON="-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON"

# 2. configure and build one variant into build dir $1 with the extra cmake flags $2
build() {
  echo "[peers] building llama-server and llama-bench in $1 ($2; -j$JOBS under nice -n 19; ~25 min on 2 busy cores)"
  # shellcheck disable=SC2086  # the flag lists are meant to split
  nice -n 19 cmake -S "$SRC" -B "$1" $COMMON $2 >"$1.configure.log" 2>&1 \
    || { tail -20 "$1.configure.log" >&2; exit 1; }
  nice -n 19 cmake --build "$1" -j "$JOBS" --target llama-server llama-bench >"$1.build.log" 2>&1 \
    || { tail -30 "$1.build.log" >&2; exit 1; }
}

# 3. the first tokens: a build whose kernels this CPU cannot run dies here, not in a benchmark
GGUF=$("$PY" -c "from engine.model.source import embedded_gguf_path; print(embedded_gguf_path())" 2>/dev/null || true)
first_tokens() {
  [ -n "$GGUF" ] || { echo "not checked (no embedded GGUF: $PY cannot import engine)"; return 0; }
  local out rc=0
  out=$(LD_LIBRARY_PATH="$1/bin" timeout 300 "$1/bin/llama-bench" -m "$GGUF" -p 0 -n 4 -r 1 -t "$JOBS" -o json 2>&1) || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "FAILED (exit $rc): $(printf '%s' "$out" | tail -3 | tr '\n' ' ')"
    return 1
  fi
  echo "ok (llama-bench -p 0 -n 4 on $(basename "$GGUF"))"
}

NATIVE=$HOME_DIR/llamacpp-build
ARGS="-DGGML_NATIVE=ON"
AMX="absent on this CPU"
if has amx_tile || has amx_int8 || has amx_bf16; then AMX="on (GGML_NATIVE: -march=native compiles ggml's AMX path)"; fi
FALLBACK=none
[ -x "$NATIVE/bin/llama-server" ] && [ -x "$NATIVE/bin/llama-bench" ] || build "$NATIVE" "$ARGS"
CHECK=$(first_tokens "$NATIVE") || {
  FIRST="$CHECK"
  echo "[peers] the native build failed its first tokens: $FIRST" >&2
  echo "[peers] falling back: GGML_NATIVE=OFF, the instruction sets named one by one, AMX off" >&2
  NATIVE=$HOME_DIR/llamacpp-build-named
  ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  for pair in avx2:AVX2 fma:FMA f16c:F16C avx_vnni:AVX_VNNI avx512f:AVX512 avx512vbmi:AVX512_VBMI \
              avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    has "${pair%%:*}" && ARGS="$ARGS -DGGML_${pair#*:}=ON"
  done
  build "$NATIVE" "$ARGS"
  CHECK=$(first_tokens "$NATIVE") || { echo "[peers] the fallback build failed too: $CHECK" >&2; exit 1; }
  FALLBACK="GGML_NATIVE=ON failed its first tokens ($FIRST); rebuilt with $ARGS"
  AMX="off (fallback)"
}

# 4. one folder to run from
mkdir -p "$BIN"
cp -f "$NATIVE/bin/llama-server" "$NATIVE/bin/llama-bench" "$BIN/"
cp -af "$NATIVE"/bin/lib*.so* "$BIN/"
CPU_FLAGS=""
for f in avx2 fma f16c avx_vnni avx512f avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16; do
  has "$f" && CPU_FLAGS="$CPU_FLAGS $f"
done
# (the values go through the environment: a failure's text may hold any character)
V_VERSION=$VERSION V_COMMIT=$COMMIT V_SRC=$SRC V_BUILD=$NATIVE V_ARGS=$ARGS V_FLAGS=${CPU_FLAGS# } V_AMX=$AMX \
V_FALLBACK=$FALLBACK V_CHECK=$CHECK "$PYTHON" - "$BIN/BUILD_INFO.json" <<'EOF'
import json, os, sys
e = os.environ
json.dump({"llama_cpp_python": e["V_VERSION"], "llama_cpp_commit": e["V_COMMIT"], "source": e["V_SRC"],
           "build_dir": e["V_BUILD"], "cmake_flags": e["V_ARGS"], "cpu_flags": e["V_FLAGS"].split(),
           "amx": e["V_AMX"], "fallback": e["V_FALLBACK"], "first_tokens": e["V_CHECK"]},
          open(sys.argv[1], "w"), indent=2)
EOF
echo "[peers] ready: $BIN/llama-server, $BIN/llama-bench (run with LD_LIBRARY_PATH=$BIN); llama.cpp $COMMIT, $ARGS; AMX $AMX; fallback: $FALLBACK"
