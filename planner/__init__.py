"""The planner: chooses pipeline, tensor and data parallelism for a model on a cluster (a dry run,
no GPUs needed) and writes the plan file the runtime executes. See docs/planner.md.

Modules, from inputs to output:

* ``config`` (Hydra config -> ``inputs.Inputs``), ``model_specs`` (analytic per-layer costs of model
  presets), ``profile`` / ``measure`` / ``graph_txt`` (per-layer profiles: analytic, measured on this
  device, or imported from PipeDream's graph.txt), ``hardware`` (cluster topologies; the device
  sheets themselves are ``pipedream.devices``);
* ``cost`` (closed-form compute, communication and memory formulas), ``uniform_cost`` (the cost of
  equal-block pipelines, vectorised over micro-batch sizes), ``ranking`` (candidates, ranking and
  "why it lost");
* the searches: ``ptdp`` (PTD-P), ``two_bw_search`` (PipeDream-2BW), ``pipedream_dp`` and
  ``pipedream_search`` (PipeDream's hierarchical dynamic program, then ranked); ``auto`` picks one and
  assembles the plan, ``simcheck`` replays it in the runtime's schedule simulator;
* ``report`` (the printed tables), ``__main__`` (``python -m planner``). The plan file's schema is
  ``pipedream.plan_file``; ``plan`` re-exports it under the planner's name.
"""
from __future__ import annotations

from pipedream.plan_file import Plan, PlanError, load_plan

__all__ = ["Plan", "PlanError", "load_plan"]
