"""The repository's own tools, run from its root as modules (``python -m scripts.bench.runtime``):
benchmarks in scripts/bench, generators of docs sections in scripts/docs. Not shipped by
``pip install .``."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent   # the repository root
