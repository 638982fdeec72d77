"""Ranking and "why it lost", shared by the PTD-P and 2BW searches (the candidates: ``planner.candidates``).

A search feeds ``Rows`` with one numpy block per (t, p, v, recompute, schedule) (vectorised over
micro-batch sizes); ``rank`` picks the fastest configuration that fits and the next best ones.
"""
from __future__ import annotations

import numpy as np

from planner.candidates import Candidate, SearchResult
from planner.errors import DoesNotFitError, PlannerError
from planner.inputs.profile import Profile
from planner.inputs.search_inputs import Inputs
from planner.costs.uniform import Estimates, even_boundaries

GIB = 1024**3
PARTS = ("compute", "bubble", "tp_comm", "p2p_comm", "cp_comm", "ep_comm", "dp_comm")
PART_NAMES = {"compute": "compute", "bubble": "pipeline bubble", "tp_comm": "tensor-parallel all-reduces",
              "p2p_comm": "pipeline sends", "cp_comm": "context-parallel ring (exposed)",
              "ep_comm": "expert-parallel all-to-alls (exposed)",
              "dp_comm": "data-parallel all-reduce"}
MEMORY_PARTS = ("weights", "gradients", "optimizer", "activations")


class Rows:
    """Accumulates per-configuration estimates as columns. A block's keys (t, p, schedule, ...) are
    one value each, kept once with the block's row count and repeated when the table is built."""

    def __init__(self) -> None:
        self.cols: dict[str, list[np.ndarray]] = {}
        self.keys: list[dict[str, int | str]] = []
        self.counts: list[int] = []

    def add(self, est: Estimates, micro: np.ndarray, schedule: str, **keys: int) -> None:
        mask = est.valid
        n = int(np.count_nonzero(mask))
        if not n:
            return
        self.keys.append({**keys, "schedule": schedule})
        self.counts.append(n)
        put = self.cols.setdefault
        put("micro", []).append(np.asarray(micro)[mask])
        for name in ("microbatches", "iteration_time", "memory", "bubble"):
            put(name, []).append(getattr(est, name)[mask])
        for name in PARTS:
            value = est.bubble_time if name == "bubble" else getattr(est, name)
            put("t_" + name, []).append((np.zeros_like(est.iteration_time) if value is None else value)[mask])
        for name in MEMORY_PARTS:
            put("m_" + name, []).append(est.parts[name][mask])
        if est.between_steps is not None:
            put("m_between_steps", []).append(est.between_steps[mask])

    def table(self) -> dict[str, np.ndarray]:
        keys = {name: np.repeat(np.array([block[name] for block in self.keys],
                                         dtype=object if name == "schedule" else None), self.counts)
                for name in self.keys[0]}
        return {**keys, **{k: np.concatenate(v) for k, v in self.cols.items()}}


def uniform_stages(inputs: Inputs, p: int, v: int, t: int, d: int, profile: Profile | None = None,
                   c: int = 1) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """Virtual stage j = chunk * p + rank; rank r owns global ranks [r d c t, (r+1) d c t) (pp slowest);
    ``profile`` is ``inputs.profile_at(t)`` where the caller has it already."""
    bounds = even_boundaries(inputs.profile_at(t) if profile is None else profile, p * v)
    assert bounds is not None
    out = []
    for j in range(p * v):
        rank = j % p
        width = d * c * t
        out.append((int(bounds[j]), int(bounds[j + 1]), tuple(range(rank * width, (rank + 1) * width))))
    return tuple(out)


def _candidate(inputs: Inputs, algorithm: str, tab: dict[str, np.ndarray], i: int,
               profiles: dict[int, Profile] | None = None) -> Candidate:
    """Row ``i`` as a Candidate; ``profiles`` keeps the profile per t across one ranking's rows."""
    p, t, d, v = (int(tab[k][i]) for k in ("p", "t", "d", "v"))
    c, zero, reshard, ep = (int(tab[k][i]) if k in tab else default
                            for k, default in (("c", 1), ("zero", 0), ("reshard", 0), ("ep", 1)))
    profiles = {} if profiles is None else profiles
    if t not in profiles:
        profiles[t] = inputs.profile_at(t)
    rec = bool(tab["recompute"][i])
    selective = bool(tab["selective_recompute"][i]) if "selective_recompute" in tab else False
    time = float(tab["iteration_time"][i])
    batch = inputs.global_batch
    return Candidate(
        algorithm, p, t, d, v, str(tab["schedule"][i]), int(tab["micro"][i]), int(tab["microbatches"][i]),
        batch, rec, uniform_stages(inputs, p, v, t, d, profiles[t], c), time, batch / time,
        inputs.hardware_flops(batch, rec, selective) / (time * p * t * d * c) / 1e12, float(tab["bubble"][i]),
        float(tab["memory"][i]), inputs.capacity,
        {k: float(tab["t_" + k][i]) for k in PARTS if k != "ep_comm" or inputs.profile.num_experts},
        model_tflops_per_device=inputs.model_flops(batch) / (time * p * t * d * c) / 1e12,
        **{key: bool(tab[key][i]) for key in ("selective_recompute", "sequence_parallel", "distributed_optimizer")
           if key in tab}, cp=c, zero=zero, reshard_after_forward=bool(reshard),
        between_steps_bytes=float(tab["m_between_steps"][i]) if "m_between_steps" in tab else 0.0,
        memory_parts={k: float(tab["m_" + k][i]) for k in MEMORY_PARTS}, ep=ep)


def _block_count(inputs: Inputs) -> int:
    kinds = [layer.kind for layer in inputs.profile.layers]
    return kinds.count("block") or len(kinds)


def why_lost(alt: Candidate, best: Candidate) -> str:
    """One phrase: how much slower and the part of the iteration that grew most. Plans with other
    global batches (PipeDream's rounded steps) compare per sample, scaled to the best's batch."""
    if not alt.fits and alt.samples_per_s > best.samples_per_s:
        gain = alt.samples_per_s / best.samples_per_s - 1
        return (f"{gain:.0%} faster but needs {alt.memory_bytes / GIB:.1f} GiB per device "
                f"> {alt.capacity_bytes / GIB:.1f} GiB")
    over = (f"; needs {alt.memory_bytes / GIB:.1f} GiB per device > {alt.capacity_bytes / GIB:.1f} GiB"
            if not alt.fits else "")
    return _slower(alt, best) + over


def gib_pair(more: float, less: float) -> str:
    """``"1.74 vs 1.71 GiB"``: the fewest decimals (1 to 4) at which the two sizes read differently;
    sizes equal to 4 decimals add their difference in bytes."""
    for digits in range(1, 5):
        a, b = f"{more / GIB:.{digits}f}", f"{less / GIB:.{digits}f}"
        if a != b:
            return f"{a} vs {b} GiB"
    return f"{a} vs {b} GiB, {more - less:+,.0f} bytes"


def _slower(alt: Candidate, best: Candidate) -> str:
    slower = best.samples_per_s / alt.samples_per_s - 1
    if slower < 1e-6:
        if alt.memory_bytes <= best.memory_bytes:
            return "a tie: as fast, with as much memory"
        return f"as fast, but more memory ({gib_pair(alt.memory_bytes, best.memory_bytes)})"
    scale = best.global_batch / alt.global_batch
    grew = {k: alt.breakdown.get(k, 0.0) * scale - best.breakdown.get(k, 0.0) for k in PARTS}
    part = max(PARTS, key=grew.get)
    a, b = alt.breakdown.get(part, 0.0) * scale, best.breakdown.get(part, 0.0)
    unit = "per iteration" if scale == 1 else f"per {best.global_batch} samples"
    return f"{slower:.1%} slower: {PART_NAMES[part]} +{a - b:.3g} s {unit} ({a:.3g} s vs {b:.3g} s)"


def rank(inputs: Inputs, algorithm: str, rows: Rows, notes: tuple[str, ...] = ()) -> SearchResult:
    if not rows.cols:
        raise PlannerError(f"{algorithm}: no configuration of {inputs.model} matches "
                           f"train.global_batch_size={inputs.global_batch} on {inputs.cluster.num_devices} devices "
                           f"(the batch must split into d pipelines x b x m micro-batches and p must divide the "
                           f"{_block_count(inputs)} repeated blocks of its {inputs.profile.num_layers} layers; try a batch "
                           f"divisible by {inputs.cluster.num_devices} or other pins)")
    tab = rows.table()
    profiles: dict[int, Profile] = {}
    fits = tab["memory"] <= inputs.capacity
    if not fits.any():
        i = int(tab["memory"].argmin())
        frugal = _candidate(inputs, algorithm, tab, i, profiles)
        raise DoesNotFitError(
            f"{inputs.model} fits no configuration on {inputs.cluster.num_devices} x {inputs.cluster.device.name}: "
            f"the smallest needs {frugal.memory_bytes / GIB:.1f} GiB per device {frugal.describe()}, with the "
            f"{inputs.workspace / GIB:.1f} GiB reserve, but {inputs.capacity / GIB:.1f} GiB are available; add devices "
            f"or use a smaller model", smallest=frugal)
    order = np.lexsort((tab["memory"], tab["iteration_time"]))
    best = _candidate(inputs, algorithm, tab, int(order[fits[order]][0]), profiles)
    seen, alternatives = {best.key}, []
    fastest_oom = None
    for i in order:
        if len(alternatives) >= inputs.top_k and fastest_oom is not None:
            break
        if not fits[i]:
            if fastest_oom is None and tab["iteration_time"][i] < best.iteration_time:
                fastest_oom = _candidate(inputs, algorithm, tab, int(i), profiles)
            continue
        selective = bool(tab["selective_recompute"][i]) if "selective_recompute" in tab else False
        granularity = "full" if tab["recompute"][i] else "selective" if selective else "none"
        key = (int(tab["p"][i]), int(tab["t"][i]), int(tab["d"][i]), int(tab["v"][i]), tab["schedule"][i], granularity,
               *(int(tab[k][i]) if k in tab else default
                 for k, default in (("c", 1), ("zero", 0), ("reshard", 0), ("ep", 1))))
        if key in seen or len(alternatives) >= inputs.top_k:
            continue
        seen.add(key)
        alternatives.append(_candidate(inputs, algorithm, tab, int(i), profiles))
    if fastest_oom is not None:
        alternatives.append(fastest_oom)
    alternatives = [Candidate(**{**a.__dict__, "why_lost": why_lost(a, best)}) for a in alternatives]
    return SearchResult(algorithm, best, tuple(alternatives), int(len(order)), notes)
