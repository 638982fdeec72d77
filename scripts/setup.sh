#!/usr/bin/env bash
# Idempotent set-up: .venv, torch==2.13.0 when torch is missing, the project and its dev extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    # Pinned: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 has a CPU wheel on local disk.
    echo "setup: installing torch==2.13.0"
    .venv/bin/python -m pip install -q torch==2.13.0
fi
stamp=.venv/.pipedream-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "setup: installing the project (editable) with dev extras"
    .venv/bin/python -m pip install -q -e ".[dev]"
    touch "$stamp"
fi
