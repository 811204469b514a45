#!/usr/bin/env bash
# The GPU check in one command; bench/gpu_check.py says what it runs (at most 8 minutes on an H100).
#   bench/gpu_check.sh                      on a machine with an NVIDIA GPU: writes bench/results/gpu_check_<card>.json
#   bench/gpu_check.sh --dry-run            on the CPU at tiny shapes: checks the script in about a minute
#   bench/gpu_check.sh --parts kernels ...  some parts only; --out PATH, --markdown PATH: see bench/gpu_check.py
# Python: $PYTHON, else the checkout's .venv, else python3. Wheels in $SLEUTH_GPU_WHEELS (default .whl/;
# bench/gpu_wheels.sh fetches the dependencies a GPU image lacks) are installed into $SLEUTH_WHEEL_SITE (default
# /tmp/sleuth-site) and put on PYTHONPATH first. Exit status: bench/gpu_check.py's (a bit per part that did not
# finish well), 100 when the wheels do not install.
set -u
cd "$(dirname "$0")/.." || exit 100
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WHL=${SLEUTH_GPU_WHEELS:-.whl}
if compgen -G "$WHL/*.whl" > /dev/null; then
  SITE=${SLEUTH_WHEEL_SITE:-/tmp/sleuth-site}
  echo "installing $(ls "$WHL"/*.whl | wc -l) wheels from $WHL into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl \
    || { echo "bench/gpu_check.sh: the wheels in $WHL did not install" >&2; exit 100; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PY" bench/gpu_check.py "$@"
