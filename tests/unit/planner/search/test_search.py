"""The PTD-P and 2BW searches equal brute-force enumeration, evaluated by an independent scalar model."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from pipedream.devices import DEVICES
from planner.errors import PlannerError
from planner.inputs.hardware import Cluster, Level
from planner.inputs.search_inputs import Inputs
from planner.inputs.model_specs import TransformerSpec
from planner.inputs.profile import analytic_profile
from planner.search.ptdp import ptdp_search
from planner.search.two_bw import two_bw_search
from tests.support.planner_helpers import random_profile, scalar_uniform

SCHEDULES = ("1f1b", "interleaved", "gpipe")


def random_inputs(rng: random.Random) -> Inputs:
    counts = [rng.randint(1, 4)] + ([rng.randint(1, 3)] if rng.random() < 0.5 else [])
    device = replace(DEVICES["v100_16gb"], memory_bytes=1.0, half_efficiency_flops=100.0)
    levels = tuple(Level(f"L{k}", c, rng.uniform(1e3, 1e5), rng.uniform(0, 1e-4),
                         rng.choice([None, rng.uniform(1e3, 1e5) * counts[0]]) if k else None)
                   for k, c in enumerate(counts))
    cluster = Cluster("rand", device, levels, counts[0])
    if rng.random() < 0.6:
        heads = rng.choice([1, 2, 4])
        spec = TransformerSpec("t", "gpt", rng.choice([1, 2, 3, 4, 6]), heads * rng.choice([2, 4]), heads,
                               rng.choice([4, 8]), rng.choice([16, 32]), "fp32")
        profile = analytic_profile(spec, device, 1)
    else:
        spec = None
        profile = random_profile(rng, rng.randint(1, 6), blocks=rng.random() < 0.7)
    inputs = Inputs("m", profile, cluster, rng.choice([rng.randint(1, 24), 8, 12, 16, 24]), spec, reserve_gib=0.0, reserve_fraction=rng.uniform(0, 0.2),
                    max_micro_batch=rng.randint(1, 8), schedules=SCHEDULES, top_k=3)
    # a capacity between the smallest and largest need, so memory binds in many instances
    needs = [v[1] for v in enumerate_all(inputs, "ptdp").values()] or [1.0]
    cap = rng.uniform(min(needs) * 0.97, max(needs))
    device = replace(device, memory_bytes=cap)
    return replace(inputs, cluster=replace(cluster, device=device))


def enumerate_all(inputs: Inputs, algorithm: str) -> dict[tuple, tuple[float, float]]:
    n, batch = inputs.cluster.num_devices, inputs.global_batch
    heads = inputs.spec.heads if inputs.spec is not None else 1
    out = {}
    for t in range(1, n + 1):
        per_node = inputs.cluster.devices_per_node
        if n % t or heads % t or (algorithm == "2bw" and t > 1) or (per_node % t and t % per_node):
            continue
        profile = inputs.profile_at(t)
        for p in range(1, n // t + 1):
            if (n // t) % p:
                continue
            d = n // (t * p)
            for v in range(1, profile.num_layers + 1):
                for rec in (False, True):
                    for b in range(1, inputs.max_micro_batch + 1):
                        if algorithm == "2bw":
                            schedules = ["2bw" if p > 1 else "1f1b"] if v == 1 else []
                        else:
                            schedules = SCHEDULES
                        for schedule in schedules:
                            res = scalar_uniform(profile, inputs.cluster, t, p, v, d, rec, b, schedule, batch,
                                                 inputs.workspace)
                            if res is not None:
                                out[(t, p, d, v, rec, b, schedule)] = res
    return out


def check(inputs: Inputs, algorithm: str, search) -> None:
    every = enumerate_all(inputs, algorithm)
    fitting = {k: v for k, v in every.items() if v[1] <= inputs.capacity}
    if not fitting:
        with pytest.raises(PlannerError):
            search(inputs)
        return
    best_time = min(v[0] for v in fitting.values())
    result = search(inputs)
    assert result.best.iteration_time == pytest.approx(best_time, rel=1e-9)
    assert result.best.memory_bytes <= inputs.capacity
    key = (result.best.tp, result.best.pp, result.best.dp, result.best.vpp, result.best.recompute,
           result.best.micro, result.best.schedule)
    assert every[key][1] == pytest.approx(result.best.memory_bytes, rel=1e-9)
    assert result.considered == len(every)
    for alt in result.alternatives:
        assert alt.iteration_time >= result.best.iteration_time * (1 - 1e-12) or not alt.fits


@pytest.mark.parametrize("seed", range(130))
def test_ptdp_equals_brute_force(seed):
    check(random_inputs(random.Random(seed)), "ptdp", ptdp_search)


@pytest.mark.parametrize("seed", range(100))
def test_two_bw_equals_brute_force(seed):
    inputs = random_inputs(random.Random(1000 + seed))
    check(inputs, "2bw", two_bw_search)


def test_two_bw_trades_depth_or_recompute_for_memory():
    """Algorithm 1's point: when memory is tight, a deeper pipeline or recomputation makes it fit."""
    spec = TransformerSpec("t", "gpt", 8, 64, 4, 16, 64, "fp32")
    device = replace(DEVICES["v100_16gb"], half_efficiency_flops=1e6)
    cluster = Cluster("c", device, (Level("nv", 8, 1e9),), 8)
    inputs = Inputs("t", analytic_profile(spec, device, 1), cluster, 64, None, reserve_gib=0.0, reserve_fraction=0.0)
    roomy = two_bw_search(inputs).best
    needs = sorted(v[1] for v in enumerate_all(inputs, "2bw").values())
    cap = (needs[0] + roomy.memory_bytes) / 2
    tight = two_bw_search(replace(inputs, cluster=replace(cluster, device=replace(device, memory_bytes=cap)))).best
    assert tight.memory_bytes <= cap < roomy.memory_bytes
    assert tight.iteration_time >= roomy.iteration_time
    assert (tight.pp, tight.recompute, -tight.micro) != (roomy.pp, roomy.recompute, -roomy.micro)
