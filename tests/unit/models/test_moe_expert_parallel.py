"""An MoE MLP built for one rank of an expert-parallel group: only its experts, under their global
indices, marked for the expert gradient reduction; on the meta device (shape inference) its forward
exchanges nothing."""
from __future__ import annotations

import torch

from models.expert_parallel import ExpertParallel
from models.families.llama import SwiGLU, _linear
from models.families.moe import MoEMLP, MoEStatistics
from models.families.moe_facts import moe_config

MOE = moe_config({"ffn_hidden_size": 16, "num_layers": 2, "moe": {"num_experts": 4, "top_k": 2}})


def rank_one_of_two(device: str = "cpu") -> MoEMLP:
    ep = ExpertParallel(group=object(), rank=1, size=2)   # a stand-in group: any collective would fail
    with torch.device(device):
        return MoEMLP(8, MOE, MoEStatistics(4), 1, SwiGLU, _linear, ep=ep)


def test_a_rank_holds_its_experts_under_their_global_indices():
    layer = rank_one_of_two()
    assert list(layer.experts) == ["2", "3"] and layer.experts[3] is layer.experts["3"]
    torch.manual_seed(0)
    whole = MoEMLP(8, MOE, MoEStatistics(4), 1, SwiGLU, _linear)
    torch.manual_seed(0)
    layer = rank_one_of_two()
    # each expert starts from the values it has when one rank holds them all
    for name, value in layer.state_dict().items():
        torch.testing.assert_close(value, whole.state_dict()[name], rtol=0, atol=0)
    assert all(getattr(p, "expert_parallel", False) for p in layer.experts.parameters())
    assert not getattr(layer.router.weight, "expert_parallel", False)


def test_the_meta_forward_exchanges_nothing():
    layer = rank_one_of_two("meta")
    out = layer(torch.empty(2, 5, 8, device="meta"))
    assert out.shape == (2, 5, 8) and out.device.type == "meta"
