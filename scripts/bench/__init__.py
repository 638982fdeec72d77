"""Benchmarks: each module with a ``main`` runs as ``python -m scripts.bench.NAME`` from the
repository root and writes its JSON and its section of docs/benchmarks.md (and docs/bench_*.md)."""
