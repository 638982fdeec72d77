"""``python -m planner.cluster jobs=jobs.yaml fleet=gavel_simulated policy=max_min_fairness out=alloc.json``

Allocates a heterogeneous fleet among training jobs with one of Gavel's policies, from the
planner's throughput of every job on every accelerator type; ``mode=simulate`` runs a job trace
through the round-based mechanism with the heterogeneity-aware policy and its agnostic baseline.
Config: conf/gavel.yaml. Bad input ends in one line on stderr and exit status 2.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from planner.errors import PlannerError


def _plain(node: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True)


def load_setup(cfg: Any):
    """(fleet, throughput table, jobs) from a composed conf/gavel.yaml."""
    from planner.cluster.fleet import fleet_from_config, load_jobs
    from planner.cluster.throughput import ThroughputTable
    from planner.cluster.trace import generate_trace

    fleet = fleet_from_config(_plain(cfg.fleet))
    table = ThroughputTable(fleet, cfg.get("precision"), [str(o) for o in cfg.get("planner_overrides") or ()])
    if cfg.get("jobs"):
        return fleet, table, load_jobs(str(cfg.jobs))
    tr = cfg.trace
    ref = str(tr.reference_type)
    if ref not in fleet.type_names:
        raise PlannerError(f"trace.reference_type={ref} is not a type of fleet {fleet.name}: choose one of "
                           f"{', '.join(fleet.type_names)}")

    def reference_steps_per_s(job) -> float:
        row = table.row(job)
        return float(row[fleet.type_names.index(ref)] or row.max())  # cannot run there: its fastest type

    jobs = generate_trace(_plain(tr.mix), int(tr.jobs), float(tr.rate_per_hour), int(tr.seed), bool(tr.multi_gpu),
                          reference_steps_per_s, [float(f) for f in tr.slo_factors or ()])
    return fleet, table, jobs


def colocation_for(cfg: Any, jobs, T: np.ndarray, fleet, throughputs=None):
    """Space sharing's pairs (planner/cluster/colocation.py) when ``space_sharing`` is on, in
    conf/gavel.yaml or the jobs file; None when it is off. ``throughputs`` (the ThroughputTable T
    came from) gives the plans' memory that the estimate checks pairs against."""
    from planner.cluster.colocation import colocation_from, read_jobs_file_colocation

    in_file, table = read_jobs_file_colocation(str(cfg.jobs)) if cfg.get("jobs") else (False, [])
    if not (bool(cfg.get("space_sharing")) or in_file):
        return None
    factor = cfg.get("colocation_factor")
    if not table and factor is None:
        raise PlannerError("space_sharing=true needs co-located throughputs: a colocated: table in the jobs file "
                           "(docs/cluster.md, Space sharing) or colocation_factor=0.6 (an estimate)")
    memory = throughputs.memory(jobs) if factor is not None and throughputs is not None else None
    return colocation_from(table, factor, jobs, T, fleet, memory)


def problem_for(jobs, T: np.ndarray, fleet, colocation=None):
    from planner.cluster.fleet import entity_arrays
    from planner.cluster.policies import Problem

    pairs, pair_T = colocation.among(np.arange(len(jobs))) if colocation is not None else (None, None)
    entity, entity_weights = entity_arrays(jobs)
    return Problem(T, np.array(fleet.counts), np.array([j.scale_factor for j in jobs]),
                   np.array([j.weight for j in jobs]), np.array([j.steps for j in jobs]), np.array(fleet.prices),
                   deadline_s=np.array([j.slo_hours * 3600 if j.slo_hours else np.inf for j in jobs]),
                   pairs=pairs, pair_T=pair_T, entity=np.array(entity), entity_weights=np.array(entity_weights))


def policy_of(cfg: Any) -> str:
    """``policy``, with ``policy=hierarchical`` named by its level within entities (``within``)."""
    from planner.cluster.hierarchical import WITHIN
    from planner.cluster.policies import POLICIES

    policy = str(cfg.policy)
    if policy == "hierarchical":
        within = str(cfg.get("within"))
        if within not in WITHIN:
            raise PlannerError(f"within={within!r} is unknown: policy=hierarchical shares each entity's weight among "
                               f"its jobs by fairness or fifo")
        policy = f"hierarchical_{within}"
    if policy not in POLICIES:
        raise PlannerError(f"policy={policy!r} is unknown: choose one of {', '.join(POLICIES)} (or hierarchical "
                           f"with within=fairness|fifo)")
    return policy


def run_allocate(cfg: Any) -> int:
    from planner.cluster.policies import allocate
    from planner.cluster.report import allocation_json, allocation_table

    fleet, table, jobs = load_setup(cfg)
    T = table.matrix(jobs)
    problem = problem_for(jobs, T, fleet, colocation_for(cfg, jobs, T, fleet, table))
    policy = policy_of(cfg)
    alloc = allocate(policy, problem, str(cfg.heterogeneity))
    other = allocate(policy, problem, "agnostic" if alloc.heterogeneity == "aware" else "aware")
    print(f"{alloc.policy} ({alloc.heterogeneity}) on {fleet.name}: "
          + ", ".join(f"{c} x {n}" for n, c in zip(fleet.type_names, fleet.counts))
          + f"; {len(jobs)} jobs, T from {table.plans_made} planner runs (steps/s)")
    print(allocation_table(jobs, fleet, problem, alloc))
    print(f"objective ({alloc.policy}, higher is better): {alloc.objective:.6g} {alloc.heterogeneity}, "
          f"{other.objective:.6g} {other.heterogeneity}; solved in {alloc.solve_s * 1e3:.1f} ms ({alloc.lps} LPs, HiGHS)")
    if cfg.get("out"):
        agnostic = other.objective if alloc.heterogeneity == "aware" else alloc.objective
        data = allocation_json(jobs, fleet, alloc, problem, agnostic, [table.summaries(j) for j in jobs])
        Path(str(cfg.out)).write_text(json.dumps(data, indent=1), encoding="utf-8")
        print(f"wrote {cfg.out}")
    return 0


def simulate_both(cfg: Any, fleet, table, jobs, policy: str) -> tuple[list, list[dict], tuple[int, int]]:
    """The trace under ``policy``, heterogeneity-aware and agnostic: (results, metrics rows, window)."""
    from planner.cluster.simulator import simulate

    T = table.matrix(jobs)
    lo_frac, hi_frac = (float(f) for f in cfg.trace.window)
    window = (int(lo_frac * len(jobs)), max(int(hi_frac * len(jobs)), int(lo_frac * len(jobs)) + 1))
    mechanism = str(cfg.mechanism)
    if mechanism not in ("rounds", "ideal"):
        raise PlannerError(f"mechanism={mechanism!r} is unknown: choose rounds (Gavel's) or ideal (exactly X)")
    colocation = colocation_for(cfg, jobs, T, fleet, table)
    results = [simulate(jobs, T, fleet, policy, h, float(cfg.round_minutes) * 60, float(cfg.resolve_minutes) * 60,
                        mechanism, float(cfg.max_hours), colocation) for h in ("aware", "agnostic")]
    return results, [r.metrics(jobs, window) for r in results], window


def run_simulate(cfg: Any) -> int:
    from planner.cluster.fleet import jobs_to_json
    from planner.cluster.report import comparison_table, plot_results

    policy = policy_of(cfg)
    fleet, table, jobs = load_setup(cfg)
    results, rows, window = simulate_both(cfg, fleet, table, jobs, policy)
    print(f"{len(jobs)} jobs on {fleet.name} ({', '.join(f'{c} x {n}' for n, c in zip(fleet.type_names, fleet.counts))}), "
          f"{cfg.mechanism} mechanism, {cfg.round_minutes}-minute rounds; JCT over jobs {window[0]}..{window[1] - 1}")
    print(comparison_table(rows))
    aware, agnostic = rows
    if aware["avg_jct_h"] and agnostic["avg_jct_h"]:
        print(f"average JCT: agnostic / aware = {agnostic['avg_jct_h'] / aware['avg_jct_h']:.2f}x")
    if cfg.get("out"):
        data = {"fleet": {"name": fleet.name, "types": fleet.type_names, "counts": fleet.counts},
                "policy": policy, "results": rows, "jobs": jobs_to_json(jobs), "T": table.matrix(jobs).tolist()}
        Path(str(cfg.out)).write_text(json.dumps(data, indent=1), encoding="utf-8")
        print(f"wrote {cfg.out}")
    if cfg.get("plot"):
        plot_results(results, window, str(cfg.plot), f"{policy} on {fleet.name}, {len(jobs)} jobs")
        print(f"wrote {cfg.plot}")
    return 0


def run(argv: Sequence[str]) -> int:
    from planner.config import compose

    cfg = compose(argv, config_name="gavel")
    mode = str(cfg.mode)
    if mode == "allocate":
        return run_allocate(cfg)
    if mode == "simulate":
        return run_simulate(cfg)
    raise PlannerError(f"mode={mode!r} is unknown: choose allocate (one allocation) or simulate (a job trace)")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except PlannerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
