"""Harmony planning: balanced packing, the estimator that simulates Harmony's action lists, the
configuration search, the plan and its report."""
