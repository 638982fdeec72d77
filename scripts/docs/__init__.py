"""Generators of the docs' real-output sections (docs/planner.md, docs/cluster.md,
docs/convergence.md): each runs as ``python -m scripts.docs.NAME`` from the repository root."""
