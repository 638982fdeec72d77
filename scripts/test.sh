#!/usr/bin/env bash
# Sets up if needed, then runs the test suite.
#   scripts/test.sh              both tiers: tests/unit on every core (pytest-xdist), then tests/distributed
#   scripts/test.sh --unit       the fast one-process tier only, on every core
#   scripts/test.sh ARGS...      any other arguments go to pytest unchanged
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The tests start hundreds of Python processes that import this project: let them share compiled
# bytecode (__pycache__, ignored by git) instead of compiling every module again in each one.
unset PYTHONDONTWRITEBYTECODE
# The unit tier starts no processes of its own, so its tests can share the cores; the distributed
# tier's tests start 2-8 ranks each and run one at a time so those ranks do not starve each other.
# --dist load sends pending tests to whichever worker is free, so a file's long tests spread over
# the workers; on 2 cores it finished the tier sooner than worksteal and than loadfile, which keeps
# each file on one worker (planner/test_peak.py alone is a fifth of the tier).
unit_workers=$(.venv/bin/python -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))")
unit=(-n "$unit_workers" --dist load tests/unit)
if [ $# -eq 0 ]; then
    .venv/bin/python -m pytest "${unit[@]}"
    # the slowest distributed tests are listed at the end: where the tier's time goes
    exec .venv/bin/python -m pytest --durations=15 tests/distributed
fi
if [ "$1" = "--unit" ]; then
    shift
    exec .venv/bin/python -m pytest "${unit[@]}" "$@"
fi
exec .venv/bin/python -m pytest "$@"
