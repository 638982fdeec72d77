"""The training command a written plan is run with: ``scripts/train.sh`` with the plan and every
model, data and training override the planner was given, quoted for a shell, so the run builds the
model the plan was made for (the launcher refuses another model or global batch)."""
from __future__ import annotations

import shlex
from typing import Any, Sequence

CARRIED_GROUPS = ("model", "data", "train")   # what a plan was made for; planner.* and cluster* stay here


def carried_overrides(argv: Sequence[str]) -> list[str]:
    """The overrides of ``CARRIED_GROUPS`` in the order given (``+``/``++`` additions included)."""
    carried = []
    for override in argv:
        key = override.partition("=")[0].lstrip("+~")
        if key.split(".")[0] in CARRIED_GROUPS:
            carried.append(override)
    return carried


def run_command(argv: Sequence[str], cfg: Any, plan_path: str, harmony: bool) -> str:
    """``scripts/train.sh model=... <the user's overrides> parallel.plan=<plan_path>``; the model choice
    is named even when the default was planned, and a harmony plan turns clipping off (harmony_pp
    updates each pack after its backward, before a global gradient norm exists)."""
    given = carried_overrides(argv)
    named = any(o.partition("=")[0].lstrip("+") == "model" or o.startswith("model._target_=") for o in given)
    if not named and not cfg.model.get("_target_"):
        given.insert(0, f"model={cfg.model.get('preset') or cfg.model.name}")
    words = ["scripts/train.sh", *given, f"parallel.plan={plan_path}"]
    if harmony:
        words.append("train.grad_clip=0")
    return shlex.join(words)


def plan_settings(plan: Any) -> str:
    """What ``parallel.plan=`` sets beyond the layer split, as the keys it sets: the degrees (context
    and expert parallelism's among them) and the ZeRO level (``optim.distributed``)."""
    par = plan.parallel
    zero = plan.optim_distributed
    return (f"parallel.pp={par.pp} parallel.tp={par.tp} parallel.cp={plan.context_parallel} parallel.dp={par.dp} "
            f"{f'parallel.ep={plan.expert_parallel} ' if plan.expert_parallel > 1 else ''}"
            f"optim.distributed={str(zero).lower()}"
            + (" optim.reshard_after_forward=true" if plan.reshard_after_forward else ""))


def missing_data_note(cfg: Any, argv: Sequence[str]) -> str | None:
    """A plugin model trains on its own data, which planning from a profile did not need."""
    if cfg.model.get("_target_") and not any(o.startswith(("data=", "data._target_=")) for o in argv):
        return "the model is a plugin: add its data (data._target_=your_pkg.module.build_data) to that command"
    return None
