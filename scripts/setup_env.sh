#!/usr/bin/env bash
# Creates (or reuses) the virtualenv at .venv with the pinned stack: tensorflow-cpu 2.15.1, then horovod 0.28.1
# built from source against it with Gloo (about 2 minutes on 2 cores), then kparallax itself (editable).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q "tensorflow-cpu==2.15.1" absl-py tensorboard portpicker pyyaml matplotlib pytest pytest-timeout
if ! .venv/bin/python -c "import horovod.tensorflow" 2>/dev/null; then
  echo "setup_env: building horovod 0.28.1 with Gloo (about 2 minutes)..." >&2
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 \
  HOROVOD_WITHOUT_MXNET=1 .venv/bin/python -m pip install -q --no-cache-dir --no-build-isolation "horovod==0.28.1"
fi
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
.venv/bin/python -c "import horovod.tensorflow as h, tensorflow as tf; assert h.gloo_built(), 'horovod built without Gloo'; print('setup_env: tensorflow', tf.__version__, '+ horovod (gloo) ready in .venv')"
