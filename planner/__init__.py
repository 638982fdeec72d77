"""The planner: chooses pipeline, tensor, context, data and (MoE models) expert parallelism and the
ZeRO level for a model on a cluster (a dry run, no GPUs needed) and writes the plan file the runtime
executes. See docs/planner.md.

Modules, from inputs to output:

* inputs: ``config`` (Hydra config -> ``inputs.Inputs``, everything a search needs; ``pins`` checks
  pinned degrees), ``model_specs`` (analytic per-layer costs of model presets; layer and parameter
  counts and FLOPs from ``models.facts``), ``profile`` / ``measure`` / ``graph_txt`` (per-layer
  profiles: analytic, measured on this device, or imported from PipeDream's graph.txt), ``hardware``
  (cluster topologies; the device sheets are ``pipedream.devices``), ``errors`` (``PlannerError``);
* cost models: ``cost`` (closed-form compute, bubble, communication and memory formulas),
  ``collectives`` (hierarchical all-reduce times), ``zero_bubble`` (bubble and memory of zb_h2 and
  zbv), ``uniform_cost`` (the cost of equal-block pipelines, vectorised over micro-batch sizes),
  ``ranking`` (candidates, ranking and "why it lost");
* the searches: ``ptdp`` (PTD-P), ``two_bw_search`` (PipeDream-2BW; the schedule itself is
  ``pipedream.schedules.two_bw``), ``pipedream_dp`` and ``pipedream_search`` (PipeDream's
  hierarchical dynamic program, then ranked); ``auto`` picks one and assembles the plan;
  ``simcheck`` and ``simcheck_async`` replay it in the runtime's schedule simulator;
* output: ``report`` (the printed tables), ``__main__`` (``python -m planner``). The plan file's
  schema is ``pipedream.config.plan_file`` (a leaf both sides import); this package re-exports ``Plan``,
  ``PlanError`` and ``load_plan``.
"""
from __future__ import annotations

from typing import Any

__all__ = ["Plan", "PlanError", "load_plan"]


def __getattr__(name: str) -> Any:
    """The re-exports, imported when first read: ``python -m planner`` imports this package before
    its ``__main__`` can choose how numpy loads (``planner.__main__._load_numpy``)."""
    if name in __all__:
        from pipedream.config import plan_file

        return getattr(plan_file, name)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
