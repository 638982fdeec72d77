"""The planner: chooses pipeline, tensor and data parallelism for a model on a cluster (a dry run,
no GPUs needed) and writes the plan file the runtime executes. See docs/planner.md.

Modules: ``profile`` (per-layer costs; measured, analytic or imported), ``hardware`` (device sheets,
topologies), ``cost`` (shared formulas), ``pipedream_dp`` / ``two_bw`` / ``ptdp`` (the searches),
``auto`` (picks one), ``plan`` (the plan file), ``__main__`` (``python -m planner``).
"""
from __future__ import annotations

from .plan import Plan, PlanError, load_plan

__all__ = ["Plan", "PlanError", "load_plan"]
