#!/usr/bin/env bash
# Creates (or reuses) the virtualenv at .venv with the pinned stack: tensorflow-cpu 2.15.1, then horovod 0.28.1
# built from source against it with Gloo (about 2 minutes on 2 cores), then kparallax itself (editable).
# A .venv set up by this same script and setup.py, whose stack still imports, is reused without running pip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
STAMP=.venv/.kparallax-setup
WANT=$(cat scripts/setup_env.sh setup.py | sha256sum | cut -d' ' -f1)

ready() {  # the stack imports, Horovod has Gloo, and kparallax is this checkout's (TensorFlow's start-up log hidden)
  TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python -c "
import os, horovod.tensorflow as h, tensorflow as tf, kparallax, absl, portpicker, yaml, pytest, xdist
assert h.gloo_built(), 'horovod built without Gloo'
assert os.path.realpath(kparallax.__file__).startswith(os.path.realpath('kparallax')), 'kparallax is not this checkout'
print('setup_env: tensorflow', tf.__version__, '+ horovod (gloo) ready in .venv')"
}

if [ -x .venv/bin/python ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ] && ready 2>/dev/null; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q "tensorflow-cpu==2.15.1" absl-py tensorboard portpicker pyyaml matplotlib pytest pytest-timeout pytest-xdist
if ! .venv/bin/python -c "import horovod.tensorflow" 2>/dev/null; then
  echo "setup_env: building horovod 0.28.1 with Gloo (about 2 minutes)..." >&2
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 \
  HOROVOD_WITHOUT_MXNET=1 .venv/bin/python -m pip install -q --no-cache-dir --no-build-isolation "horovod==0.28.1"
fi
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
ready
echo "$WANT" > "$STAMP"
