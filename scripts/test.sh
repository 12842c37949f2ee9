#!/usr/bin/env bash
# The test command: sets up .venv, then runs every tier (single-process, in-process servers, multi-process).
#   scripts/test.sh           everything (what CI runs)
#   scripts/test.sh --fast    one process only: in-process PS server, Horovod of size 1 (about three to eight minutes)
# The one-process tier runs on 2 pytest-xdist processes, a test file to each at a time (its module fixtures, such as
# an in-process PS server, are the file's own); the multi-process tier runs one test at a time: each starts its own
# cluster of processes on this 2-core machine, and several at once would slow each other past their timeouts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
FAST=(-m "not multiprocess" -n 2 --dist loadfile)
if [[ "${1:-}" == "--fast" ]]; then
  shift
  exec .venv/bin/python -m pytest -v -rs --durations=20 "${FAST[@]}" "$@"
fi
# --durations: the slowest tests, to compare with the timeouts they run under (a slower machine must not reach them).
# Both tiers run whatever the first gives; exit status 5 (no test selected, e.g. a file of one tier) is not a failure.
status=0
start=$SECONDS
.venv/bin/python -m pytest -v -rs --durations=20 "${FAST[@]}" "$@" || status=$?
[[ $status -eq 5 ]] && status=0
fast_time=$((SECONDS - start))
second=0
start=$SECONDS
.venv/bin/python -m pytest -v -rs --durations=30 -m multiprocess "$@" || second=$?
[[ $second -eq 5 ]] && second=0
multi_time=$((SECONDS - start))
printf 'test.sh: one-process tier %dm%02ds (exit %d), multi-process tier %dm%02ds (exit %d)\n' \
  $((fast_time / 60)) $((fast_time % 60)) "$status" $((multi_time / 60)) $((multi_time % 60)) "$second"
if [[ $status -eq 0 ]]; then status=$second; fi
exit $status
