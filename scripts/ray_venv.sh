#!/usr/bin/env bash
# Makes the side venv the Ray launcher test runs in (tests/test_launcher_ray.py): hydra-ray-launcher
# needs cloudpickle < 3 where .venv's joblib declares >= 3 (pip then reports a broken environment;
# the joblib sweep test and torch.compile did still run under cloudpickle 2.2.1 here), and Ray brings
# ~380 MB of packages (grpcio, protobuf, boto3, ...) nothing else needs. The side venv holds only Ray,
# the launcher and their dependencies; everything else (torch, servelab, hydra-core) it reads from
# .venv, placed after its own site-packages, so its cloudpickle 2 wins there and .venv is never touched.
#
#   RAY_VENV  the side venv (default ~/.cache/servelab-ray; outside the tree, like the peers' venvs)
#   VENV      the main venv it layers on (default .venv, made by scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
RAY_VENV=${RAY_VENV:-$HOME/.cache/servelab-ray}
VENV=${VENV:-.venv}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$VENV/bin/python" ] || { echo "[ray-venv] $VENV is missing: run scripts/setup.sh --test first" >&2; exit 1; }
if [ ! -x "$RAY_VENV/bin/python" ]; then
  echo "[ray-venv] creating $RAY_VENV on top of $VENV"
  "$VENV/bin/python" -m venv "$RAY_VENV"
fi
own=$("$RAY_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
main=$(cd "$VENV" && "$(pwd)/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# addsitedir (not a bare path line) so .venv's own .pth files (servelab's editable install) are read too.
echo "import site; site.addsitedir('$main')" > "$own/zz_servelab_main_venv.pth"
if ! "$RAY_VENV/bin/python" -m pip install -q -c constraints.txt hydra-ray-launcher ray "cloudpickle<3"; then
  echo "[ray-venv] failed: pip install hydra-ray-launcher ray (pip's message above)" >&2
  exit 1
fi
"$RAY_VENV/bin/python" -c "import cloudpickle, ray, hydra_plugins.hydra_ray_launcher, torch, engine
print('[ray-venv] ok: ray', ray.__version__, 'cloudpickle', cloudpickle.__version__, 'torch', torch.__version__)"
