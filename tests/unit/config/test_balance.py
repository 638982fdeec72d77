from __future__ import annotations

import itertools
import random

import pytest
import torch

from pipedream.config.balance import balanced_counts, estimated_seconds, integer_costs
from pipedream.config.layout import split_layers
from pipedream.config.loading import compose_config
from pipedream.config.run_spec import build_run_spec


def _splits(n: int, s: int):
    for cuts in itertools.combinations(range(1, n), s - 1):
        edges = (0, *cuts, n)
        yield [edges[i + 1] - edges[i] for i in range(s)]


def _stage_costs(costs, counts):
    out, start = [], 0
    for count in counts:
        out.append(sum(costs[start:start + count]))
        start += count
    return out


@pytest.mark.parametrize("n,s", [(6, 4), (8, 2), (7, 3), (13, 4), (5, 5)])
def test_equal_costs_give_the_even_split(n, s):
    base, extra = divmod(n, s)
    assert balanced_counts([3.0] * n, s) == [base + (1 if i < extra else 0) for i in range(s)]
    assert balanced_counts([0.0] * n, s) == [base + (1 if i < extra else 0) for i in range(s)]


def test_light_embedding_and_head_go_with_blocks():
    # [embedding, 4 blocks, head]: an even split by count gives one stage two blocks, another none
    gpt = [0.0, 54.5, 54.5, 54.5, 54.5, 8.4]
    assert balanced_counts(gpt, 4) == [2, 1, 1, 2]
    assert balanced_counts(gpt, 2) == [3, 3]


def test_least_costly_worst_stage_on_random_layers():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 9)
        s = rng.randint(1, n)
        costs = [rng.choice([0.0, 1.0, 2.0, 5.0, rng.random() * 10]) for _ in range(n)]
        chosen = balanced_counts(costs, s)
        assert len(chosen) == s and sum(chosen) == n and min(chosen) >= 1
        weights = integer_costs(costs)
        best = min(max(_stage_costs(weights, counts)) for counts in _splits(n, s))
        assert max(_stage_costs(weights, chosen)) == best


def test_too_many_stages_is_refused():
    with pytest.raises(ValueError, match="cannot fill"):
        balanced_counts([1.0, 1.0], 3)


def test_operators_weigh_most_on_small_layers():
    # one big GEMM against many small operators: on a CPU at a small batch the operators dominate
    counts = [(1e9, 2), (1e3, 200)]
    cpu = estimated_seconds(counts, counted_batch=2, micro_batch=2, device="cpu")
    assert cpu[0] == pytest.approx(1e9 / 5e10 + 2e-5) and cpu[1] > 1e-3
    gpu = estimated_seconds(counts, counted_batch=2, micro_batch=64, device="cuda:0")
    assert gpu[0] == pytest.approx(32e9 / 1e14 + 1e-5)


def test_split_layers_uses_costs_only_without_an_explicit_split():
    assert split_layers(6, 4, None, [0, 5, 5, 5, 5, 1]) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert split_layers(6, 4, [1, 2, 2, 1], [0, 5, 5, 5, 5, 1]) == [(0, 1), (1, 3), (3, 5), (5, 6)]
    assert split_layers(6, 4) == [(0, 2), (2, 4), (4, 5), (5, 6)]


def _counts(spec):
    return [end - start for start, end in spec.bounds]


def test_default_split_balances_a_gpt_and_keeps_an_explicit_one():
    assert _counts(build_run_spec(compose_config(["model=gpt_tiny", "parallel.pp=4"]))) == [2, 1, 1, 2]
    assert _counts(build_run_spec(compose_config(["model=gpt_tiny", "parallel.pp=2", "schedule=zbv"]))) == [2, 1, 1, 2]
    assert _counts(build_run_spec(compose_config(["model=gpt_tiny", "parallel.pp=4",
                                                  "parallel.layers_per_stage=[2,2,1,1]"]))) == [2, 2, 1, 1]
    # [embedding + 3 blocks], 3 blocks, 3 blocks, [3 blocks + head]: no stage with 4 blocks
    assert _counts(build_run_spec(compose_config(["model=gpt_small", "parallel.pp=4"]))) == [4, 3, 3, 4]


def test_default_split_of_a_plugin_made_of_torch_modules():
    stock = "scripts.bench.runtime_stock_model"
    common = [f"model._target_={stock}.build", f"data._target_={stock}.data", "parallel.pp=2",
              "train.micro_batch_size=8", "train.global_batch_size=64"]
    # [embedding, 4 encoder blocks, LayerNorm, Linear]: two blocks per rank in both placements
    assert _counts(build_run_spec(compose_config(common))) == [3, 4]
    assert _counts(build_run_spec(compose_config(common + ["schedule=zbv"]))) == [2, 1, 1, 3]


def test_counting_the_layers_leaves_the_random_stream_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    build_run_spec(compose_config(["model=gpt_tiny", "parallel.pp=4"]))
    assert torch.equal(torch.rand(4), expected)
