"""The plan file's schema under its planner name, for callers that import it from here. It is
defined in ``pipedream.plan_file``, so the runtime reads plan files without importing the planner."""
from __future__ import annotations

from pipedream.plan_file import (PLAN_VERSION, Batch, ClusterInfo, ModelInfo, Parallel, Plan, PlanError, Predicted,
                                 Stage, load_plan, plan_from_json)

__all__ = ["PLAN_VERSION", "Batch", "ClusterInfo", "ModelInfo", "Parallel", "Plan", "PlanError", "Predicted", "Stage",
           "load_plan", "plan_from_json"]
