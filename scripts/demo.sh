#!/usr/bin/env bash
# Main job on the local default: 1 PS task + 2 Horovod workers on this machine, training the demo model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/kparallax-run --workers 2 --ps 1 -- .venv/bin/python examples/demo.py "$@"
