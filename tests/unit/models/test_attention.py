"""The attention core and selective recomputation (models/attention.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from models.attention import CoreAttention, selectively_recompute


def _saved_bytes(fn) -> int:
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, out


def _qkv(kv_heads: int = 4) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 32, 8, generator=generator, requires_grad=True)
    k = torch.randn(2, kv_heads, 32, 8, generator=generator, requires_grad=True)
    v = torch.randn(2, kv_heads, 32, 8, generator=generator, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("dropout,kv_heads", [(0.0, 4), (0.3, 4), (0.0, 2)])
def test_recomputed_core_gives_the_same_values_and_gradients(dropout, kv_heads):
    results = []
    for recompute in (False, True):
        core = CoreAttention(causal=True, dropout=dropout)
        core.recompute = recompute
        q, k, v = _qkv(kv_heads)
        torch.manual_seed(7)   # the same dropout mask both times: the recomputation must replay it
        out = core(q, k, v)
        out.square().sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for plain, recomputed in zip(*results):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)


def test_recomputed_core_keeps_only_its_inputs():
    q, k, v = _qkv()
    core = CoreAttention(causal=True, dropout=0.0)
    kept, _ = _saved_bytes(lambda: core(q, k, v))
    core.recompute = True
    recomputed, _ = _saved_bytes(lambda: core(q, k, v))
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v))
    assert recomputed <= inputs < kept


def test_without_grad_or_in_eval_nothing_is_checkpointed():
    core = CoreAttention(dropout=0.5)
    core.recompute = True
    q, k, v = _qkv()
    core.eval()
    with torch.no_grad():
        out = core(q, k, v)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_the_rng_context_is_entered_only_for_dropout_in_training():
    entered = []

    class Stream:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return False

    q, k, v = _qkv()
    CoreAttention(dropout=0.0)(q, k, v, rng=Stream)
    assert not entered
    CoreAttention(dropout=0.1)(q, k, v, rng=Stream)
    assert entered == [True]


def test_selectively_recompute_switches_every_core_in_a_gpt_and_no_state_changes():
    from models import build_model

    cfg = {"name": "gpt", "num_layers": 4, "hidden_size": 32, "num_heads": 2, "seq_len": 16, "vocab_size": 64,
           "tie_embeddings": True, "dropout": 0.0}
    model = build_model(cfg)
    layers = list(model.build().values())
    before = [list(layer.state_dict()) for layer in layers]
    assert selectively_recompute(layers) == 4   # one per block
    assert all(m.recompute for layer in layers for m in layer.modules() if isinstance(m, CoreAttention))
    assert [list(layer.state_dict()) for layer in layers] == before
    assert selectively_recompute([nn.Linear(2, 2)]) == 0


def test_a_tensor_parallel_ranks_own_dropout_stream_is_replayed():
    from models.tensor_parallel.random import RNGTracker

    tracker = RNGTracker(seed=3, tp_rank=1)
    results = []
    for recompute in (False, True):
        core = CoreAttention(dropout=0.3)
        core.recompute = recompute
        q, k, v = _qkv()
        torch.manual_seed(11)
        out = core(q, k, v, rng=tracker.fork)
        out.square().sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad, torch.get_rng_state()))
    for plain, recomputed in zip(*results):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)
