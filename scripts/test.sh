#!/usr/bin/env bash
# The test command: sets up .venv, then runs every tier (single-process, in-process servers, multi-process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -v -rs "$@"
