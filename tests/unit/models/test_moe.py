"""MoE layers (models.families.moe): routing renormalises the top-k weights or not, capacity drops
overflow by token order and counts it, one expert with top-1 is the dense SwiGLU, the built model
has the parameters the facts count, the load-balancing loss is transformers' one, the auxiliary
gradient follows the loss scale, and a recomputed forward is not counted twice."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.checkpoint import checkpoint

from models import build_model
from models.facts import parameter_count
from models.families.llama import SwiGLU, _linear
from models.families.moe import MoEMLP, MoEStatistics, capacity_keep, load_balancing_loss, route
from models.families.moe_facts import moe_config

CONF = Path(__file__).resolve().parents[3] / "conf" / "model"
TINY = yaml.safe_load((CONF / "mixtral_tiny.yaml").read_text())


def config(**moe) -> dict:
    return {**TINY, "moe": {**TINY["moe"], **moe}}


def mlp(statistics: MoEStatistics | None = None, **moe) -> MoEMLP:
    torch.manual_seed(0)
    cfg = moe_config(config(**moe))
    return MoEMLP(TINY["hidden_size"], cfg, statistics or MoEStatistics(cfg.num_experts), 1, SwiGLU, _linear)


def test_top_k_weights_are_renormalised_or_the_raw_probabilities():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    probs, weights, experts = route(logits, 2, renormalize=True)
    assert experts.tolist() == [[0, 1], [2, 3]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    _, raw, _ = route(logits, 2, renormalize=False)
    torch.testing.assert_close(raw, probs.gather(1, experts))
    assert (raw.sum(-1) < 1).all()


def test_capacity_drops_overflow_by_token_order():
    slots = torch.tensor([0, 1, 0, 2, 0, 1, 0, 3])   # 4 tokens x top-2, token-major
    assert capacity_keep(slots, 4, None).all()
    assert capacity_keep(slots, 4, 2).tolist() == [True, True, True, True, False, True, False, True]


def test_a_capacity_drop_is_deterministic_and_counted():
    statistics = MoEStatistics(4)
    layer = mlp(statistics, capacity_factor=0.5)
    x = torch.randn(2, 8, TINY["hidden_size"], generator=torch.Generator().manual_seed(1))
    first, second = layer(x), layer(x)
    assert torch.equal(first, second)
    report = statistics.report(statistics.sums())
    slots = 2 * 16 * 2   # two forwards of 16 tokens, top-2
    assert report["moe_tokens_dropped"] > 0 and sum(report["moe_tokens_per_expert"]) == slots
    # each forward: every expert takes at most ceil(0.5 * 16 * 2 / 4) = 4 of the slots routed to it
    kept = slots - report["moe_tokens_dropped"]
    assert kept <= 2 * 4 * 4


def test_one_expert_top_one_is_the_dense_swiglu():
    layer = mlp(num_experts=1, top_k=1)
    dense = SwiGLU(TINY["hidden_size"], TINY["ffn_hidden_size"])
    dense.load_state_dict(layer.experts[0].state_dict())
    x = torch.randn(3, 5, TINY["hidden_size"], generator=torch.Generator().manual_seed(2))
    layer.eval()   # no auxiliary objective: the forward alone
    torch.testing.assert_close(layer(x), dense(x), rtol=0, atol=0)


@pytest.mark.parametrize("moe", [{}, {"shared_experts": 2, "shared_expert_ffn_hidden_size": 8,
                                      "shared_expert_gate": True, "every": 2, "expert_ffn_hidden_size": 16}])
def test_the_built_model_has_the_counted_parameters(moe):
    cfg = config(**moe)
    network = build_model(cfg).build_sequential()
    assert sum(p.numel() for p in network.parameters()) == parameter_count(cfg)
    kinds = [type(block.mlp).__name__ for block in list(network)[1:-1]]
    every = cfg["moe"]["every"]
    assert kinds == ["MoEMLP" if (b + 1) % every == 0 else "SwiGLU" for b in range(TINY["num_layers"])]


def test_the_load_balancing_loss_is_transformers_mixtral_one():
    modeling = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    logits = torch.randn(24, 4, generator=torch.Generator().manual_seed(3))
    probs, _, experts = route(logits, 2, renormalize=True)
    expected = modeling.load_balancing_loss_func((logits,), num_experts=4, top_k=2)
    torch.testing.assert_close(load_balancing_loss(probs, experts.reshape(-1), 4), expected)


def test_the_auxiliary_gradient_is_the_objectives_times_the_loss_scale():
    x = torch.randn(2, 8, TINY["hidden_size"], generator=torch.Generator().manual_seed(4))
    explicit_stats = MoEStatistics(4)
    explicit = mlp(explicit_stats, z_loss_coef=0.01)
    explicit_stats.collected = []
    (0.25 * (explicit(x).square().sum() + sum(explicit_stats.collected))).backward()
    scaled_stats = MoEStatistics(4)
    scaled = mlp(scaled_stats, z_loss_coef=0.01)
    scaled_stats.loss_scale = 0.25   # what the runtime multiplies the micro-batch's loss by
    (0.25 * scaled(x).square().sum()).backward()
    for (name, a), b in zip(explicit.named_parameters(), scaled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    assert explicit.router.weight.grad.abs().sum() > 0


def test_a_recomputed_forward_is_counted_once():
    statistics = MoEStatistics(4)
    layer = mlp(statistics)
    x = torch.randn(2, 8, TINY["hidden_size"], requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert sum(statistics.report(statistics.sums())["moe_tokens_per_expert"]) == 16 * 2
    layer.eval()
    with torch.no_grad():
        layer(x)
    assert statistics.sums()[-1] == 0   # evaluation is not counted


def test_the_hugging_face_export_refuses_what_mixtral_cannot_hold_in_one_line():
    from models.errors import ConfigError
    from models.families.llama_hf import to_hf
    with pytest.raises(ConfigError, match=r"^model.moe.shared_experts=2: the Hugging Face export writes Mixtral") \
            as error:
        to_hf({}, config(shared_experts=2))
    assert "\n" not in str(error.value)
