from __future__ import annotations

import pytest
import torch

from models import gpt_model, mlp_model
from models.families.formulas import gpt_flops_per_iteration, gpt_parameters, training_days


@pytest.mark.parametrize("layers,hidden,seq,vocab", [(2, 64, 32, 256), (3, 96, 128, 512), (1, 16, 8, 256)])
def test_eq_4_3_matches_counted_parameters(layers, hidden, seq, vocab):
    network = gpt_model(layers, hidden, 4, seq, vocab, tie_embeddings=True).build_sequential()
    counted = sum(p.numel() for p in network.parameters())
    assert counted == gpt_parameters(layers, hidden, vocab, seq) + 2 * hidden  # + final LayerNorm


def test_untied_head_adds_a_vocabulary_matrix():
    tied = sum(p.numel() for p in gpt_model(2, 32, 2, 16).build_sequential().parameters())
    untied = sum(p.numel() for p in gpt_model(2, 32, 2, 16, tie_embeddings=False).build_sequential().parameters())
    assert untied - tied == 256 * 32


def test_eq_4_2_flops_and_eq_4_4_gpt3_example():
    b, s, l, h, v = 8, 2048, 24, 2048, 51200
    expected = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert gpt_flops_per_iteration(b, l, h, v, s) == pytest.approx(expected, rel=1e-12)
    no_recompute = gpt_flops_per_iteration(b, l, h, v, s, recompute=False)
    assert no_recompute == pytest.approx(72 * b * s * l * h * h * (1 + s / (6 * h)) + 6 * b * s * h * v)
    assert training_days(300e9, 175e9, 1024, 140e12) == pytest.approx(34, abs=0.5)


def test_layers_build_alone_with_the_same_weights():
    model = gpt_model(3, 32, 2, 16)
    whole = model.build_sequential()
    alone = model.build([2])[2]
    for (_, a), (_, b) in zip(whole[2].named_parameters(), alone.named_parameters()):
        assert torch.equal(a, b)
    head_alone = model.build([4])[4]
    assert torch.equal(head_alone.weight, whole[0].wte.weight)  # tied head starts equal
    assert whole[4].weight is whole[0].wte.weight               # and is one parameter in one process


def test_gpt_is_causal_and_mlp_runs():
    model = gpt_model(2, 32, 2, 16)
    network = model.build_sequential()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % 256
    assert torch.allclose(network(x)[0, :-1], network(y)[0, :-1])
    mlp = mlp_model(3, 8).build_sequential()
    assert mlp(torch.randn(4, 8)).shape == (4, 8)
