#!/usr/bin/env bash
# The test command: sets up .venv, then runs every tier (single-process, in-process servers, multi-process).
#   scripts/test.sh           everything (what CI runs)
#   scripts/test.sh --fast    one process only: in-process PS server, Horovod of size 1 (about five to six minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if [[ "${1:-}" == "--fast" ]]; then
  shift
  exec .venv/bin/python -m pytest -v -rs --durations=20 -m "not multiprocess" "$@"
fi
# --durations: the slowest tests, to compare with the timeouts they run under (a slower machine must not reach them).
exec .venv/bin/python -m pytest -v -rs --durations=30 "$@"
