"""Printed tables, JSON and the plot of ``python -m planner.cluster``."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from planner.cluster.fleet import Fleet, Job, jobs_to_json
from planner.cluster.policies import Allocation, Problem
from planner.cluster.simulator import SimResult


def allocation_table(jobs: Sequence[Job], fleet: Fleet, problem: Problem, alloc: Allocation) -> str:
    names = fleet.type_names
    T = problem.T
    thr = problem.throughput(alloc.X)
    head = (f"{'job':<12} {'model':<12} {'batch':>5} {'GPUs':>4}  "
            + "  ".join(f"{'T ' + n:>9}" for n in names) + "  " + "  ".join(f"{'X ' + n:>7}" for n in names)
            + f"  {'steps/s':>9} {'done in h':>9}")
    lines = [head]
    for m, job in enumerate(jobs):
        hours = job.steps / thr[m] / 3600 if thr[m] > 0 else float("inf")
        lines.append(f"{job.name[:12]:<12} {job.model[:12]:<12} {job.batch:>5} {job.scale_factor:>4}  "
                     + "  ".join(f"{v:>9.4g}" for v in T[m]) + "  " + "  ".join(f"{v:>7.3f}" for v in alloc.X[m])
                     + f"  {thr[m]:>9.4g} {hours:>9.3g}")
    n = len(jobs)
    for q in np.flatnonzero(alloc.X[n:].sum(axis=1) > 1e-6):  # pairs sharing a GPU (space sharing)
        a, b = problem.pairs[q]
        rates = "  ".join(f"{f'{x:.3g}/{y:.3g}':>9}" for x, y in problem.pair_T[q])
        lines.append(f"{'+ pair':<12} {(jobs[a].name[:6] + '+' + jobs[b].name[:5]):<12} {'':>5} {jobs[a].scale_factor:>4}  "
                     + rates + "  " + "  ".join(f"{v:>7.3f}" for v in alloc.X[n + q]))
    used = (alloc.X * problem.row_scale()[:, None]).sum(axis=0)
    lines.append("GPUs busy on average: " + ", ".join(f"{n} {u:.2f} of {c}" for n, u, c in zip(names, used, fleet.counts)))
    if any(job.entity is not None for job in jobs):
        lines.append(entity_line(jobs, problem, alloc))
    return "\n".join(lines)


def entity_line(jobs: Sequence[Job], problem: Problem, alloc: Allocation) -> str:
    """Each named entity's weight and its jobs' normalised shares summed (scale x throughput /
    throughput at X^equal), the quantity the hierarchical policies share out by weight."""
    from planner.cluster.hierarchical import normalised_share

    share = normalised_share(problem) * problem.throughput(alloc.X)
    named: dict[str, list[int]] = {}
    for m, job in enumerate(jobs):
        if job.entity is not None:
            named.setdefault(job.entity, []).append(m)
    return "entity shares (scale x steps/s over X^equal's, summed): " + ", ".join(
        f"{name} (weight {jobs[ms[0]].entity_weight:g}) {share[ms].sum():.3f}" for name, ms in named.items())


def allocation_json(jobs: Sequence[Job], fleet: Fleet, alloc: Allocation, problem: Problem,
                    agnostic_objective: float, plans: Sequence[dict]) -> dict:
    T = problem.T
    thr = problem.throughput(alloc.X)
    n = len(jobs)
    return {"fleet": {"name": fleet.name, "types": fleet.type_names, "counts": fleet.counts, "prices": fleet.prices},
            "policy": alloc.policy, "heterogeneity": alloc.heterogeneity, "objective": alloc.objective,
            "objective_agnostic": agnostic_objective, "solve_s": alloc.solve_s, "lps": alloc.lps,
            "jobs": [{**row, "throughput_steps_per_s": T[m].tolist(), "allocation": alloc.X[m].tolist(),
                      "effective_steps_per_s": float(thr[m]),
                      "completion_h": float(row["steps"] / thr[m] / 3600) if thr[m] > 0 else None,
                      "plans": plans[m]}
                     for m, row in enumerate(jobs_to_json(jobs))],
            "pairs": [{"jobs": [jobs[int(a)].name, jobs[int(b)].name], "throughput_steps_per_s": problem.pair_T[q].tolist(),
                       "allocation": alloc.X[n + q].tolist()} for q, (a, b) in enumerate(problem.pairs)]
            if problem.num_pairs else [],
            "scale_factors": problem.scale.tolist()}


def comparison_table(rows: Sequence[dict]) -> str:
    head = (f"{'policy':<22} {'variant':<9} {'avg JCT h':>9} {'median h':>9} {'makespan h':>10} {'cost $':>10} "
            f"{'SLO missed':>10} {'solves':>6} {'LP s':>6}")
    lines = [head]
    for r in rows:
        def num(key, fmt):
            return format(r[key], fmt) if r.get(key) is not None else "-"
        slo = f"{r['slo_violations']}/{r['slo_jobs']}" if r["slo_jobs"] else "-"
        lines.append(f"{r['policy']:<22} {r['heterogeneity']:<9} {num('avg_jct_h', '>9.2f')} {num('median_jct_h', '>9.2f')} "
                     f"{num('makespan_h', '>10.1f')} {num('cost_dollars', '>10.0f')} {slo:>10} {r['solves']:>6} "
                     f"{r['solve_s']:>6.1f}")
    return "\n".join(lines)


def plot_results(results: Sequence[SimResult], window: tuple[int, int], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    lo, hi = window
    for res in results:
        label = f"{res.policy} ({res.heterogeneity})"
        jct = np.sort(res.jct_h[lo:hi][np.isfinite(res.jct_h[lo:hi])])
        left.plot(jct, np.arange(1, len(jct) + 1) / max(len(jct), 1), label=label)
        hours = [h for h, _, _ in res.timeline]
        right.plot(hours, [b for _, _, b in res.timeline], label=label, linewidth=0.8)
    left.set_xscale("log")
    left.set_xlabel("job completion time (hours)")
    left.set_ylabel("fraction of jobs")
    left.set_title("JCT CDF (measured window)")
    right.set_xlabel("hours")
    right.set_ylabel("GPUs busy")
    right.set_title("cluster use")
    left.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
