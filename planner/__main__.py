"""``python -m planner model=... cluster=... train.global_batch_size=... planner.out=plan.json``

The dry run: choose a plan, print it with the alternatives and the end-to-end training time,
write the plan JSON. ``planner.validate=plan.json planner.world_size=N`` checks a plan file
instead. Bad input ends in one line on stderr and exit status 2.
"""
from __future__ import annotations

import os
import sys
from typing import Sequence

from models.registry import known_family

from planner.errors import PlannerError

BLAS_THREADS = "OPENBLAS_NUM_THREADS"


def _load_numpy() -> None:
    """numpy with one BLAS thread, unless ``OPENBLAS_NUM_THREADS`` says otherwise. numpy's OpenBLAS
    starts a pool of threads as it loads, which then spin on the other cores for a while: 0.04-0.05 s
    of CPU time, a fifth of a small plan's on this 2-core machine. The planner multiplies no matrices
    with numpy (``cluster=local_cpu`` measures the machine with torch, whose BLAS is its own); the
    variable is removed again once numpy is loaded, so nothing started later inherits it."""
    if "numpy" in sys.modules or BLAS_THREADS in os.environ:
        return
    os.environ[BLAS_THREADS] = "1"
    try:
        import numpy  # noqa: F401 - loaded now, with the variable set
    finally:
        del os.environ[BLAS_THREADS]


def run(argv: Sequence[str]) -> int:
    from pipedream.config.plan_file import load_plan
    from planner.search.auto import make_plan
    from planner.config import compose, inputs_from_config
    from planner.report import alternatives_table, harmony_table, plan_table, training_time

    cfg = compose(argv, plain_dicts=True)
    p = cfg.planner
    if p.get("validate"):
        plan = load_plan(str(p.validate))
        if p.get("world_size") is not None:
            plan.check_world_size(int(p.world_size))
        print(f"{p.validate}: valid plan for {plan.world_size} processes "
              f"(pp={plan.parallel.pp} tp={plan.parallel.tp} cp={plan.context_parallel} dp={plan.parallel.dp}, "
              f"{plan.schedule}, optim.distributed={str(plan.optim_distributed).lower()}"
              f"{', optim.reshard_after_forward=true' if plan.reshard_after_forward else ''})")
        return 0
    if p.get("out"):   # before planning: a typo in the path must not cost the search
        from pipedream.observe.run_outputs import output_path_problem
        problem = output_path_problem(str(p.out), is_file=True)
        if problem:
            raise PlannerError(f"planner.out={p.out} {problem}: give a file path in a folder you can write to")
    inputs = inputs_from_config(cfg)
    outcome = make_plan(inputs, str(p.algorithm), str(p.semantics), bool(p.simulate))
    precision = inputs.spec.precision if inputs.spec is not None else inputs.profile.precision
    if outcome.harmony is not None:
        print(harmony_table(outcome, inputs.cluster.device.flops(precision)))
    else:
        print(plan_table(outcome, inputs.cluster.device.flops(precision)))
    print()
    print(alternatives_table(outcome))
    print()
    family = known_family(cfg.model.get("name"))
    sequence_model = family is not None and family.sequence and inputs.profile.source != "graph.txt"
    seq = cfg.model.get("seq_len") if sequence_model else None
    tokens = p.get("train_tokens") if p.get("train_tokens") is not None else cfg.model.get("train_tokens")
    print(training_time(outcome, None if tokens is None else float(tokens), seq))
    if p.get("out"):
        outcome.plan.save(str(p.out))
        from planner.run_line import missing_data_note, plan_settings, run_command
        print(f"wrote {p.out} (it sets {plan_settings(outcome.plan)}); run it with: "
              f"{run_command(argv, cfg, str(p.out), outcome.harmony is not None)}")
        note = missing_data_note(cfg, argv)
        if note:
            print(f"note: {note}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    _load_numpy()
    from pipedream.config.plan_file import PlanError

    try:
        return run(sys.argv[1:] if argv is None else argv)
    except (PlannerError, PlanError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
