"""recompute.num_layers = k: a stage chunk recomputes only its first k layers. What it stashes lies
between keeping everything and recomputing the whole chunk, and its gradients are the same."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from models.spec import PipelineSequential
from pipedream.runtime.stage import Stage


def _chunk() -> nn.Module:
    torch.manual_seed(0)
    return PipelineSequential(*(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 16))
                                for _ in range(4)))


def _run(recompute: bool, layers: int | None) -> tuple[int, list[torch.Tensor]]:
    chunk = _chunk()
    stage = Stage([chunk], [True], [True], lambda out, target: ((out - target) ** 2).mean(),
                  recompute=recompute, recompute_layers=layers)
    torch.manual_seed(1)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    stage.forward(0, 0, x, y)
    stashed = stage.stats.peak_bytes
    stage.backward(0, 0)
    return stashed, [p.grad.clone() for p in chunk.parameters()]


def test_stashed_bytes_lie_between_none_and_full_and_gradients_match():
    none, reference = _run(False, None)
    full, full_grads = _run(True, None)
    partial = {k: _run(True, k) for k in (0, 1, 2, 4, 9)}
    assert full < partial[2][0] < partial[1][0] < none   # fewer layers recomputed, more kept
    assert partial[0][0] == none and partial[4][0] == partial[9][0] == full   # k = 0: none; k >= layers: all
    for _, grads in [(full, full_grads), *partial.values()]:
        for got, want in zip(grads, reference):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
