#!/usr/bin/env bash
# Sets up if needed, then runs the default training job through the launcher.
# Arguments are Hydra overrides, e.g. scripts/train.sh model=gpt_small train.steps=500
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m launcher "$@"
