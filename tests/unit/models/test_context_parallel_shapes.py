"""What crosses a pipeline-stage boundary of a context-parallel model, found as the runtime's shape
inference finds it (layers built and run on the meta device, nothing communicated): with cp the
hidden states are [batch, s/cp, hidden] (the rank's zigzag shard), with tensor parallelism too,
and with sequence parallelism [batch, s/(cp·t), hidden]; layer 0 takes the shard's tokens
[batch, s/cp] and the head gives [batch, s/cp, vocabulary (padded) / t] for targets [batch, s/cp]."""
from __future__ import annotations

import pytest
import torch

from models import build_model
from models.context_parallel import ContextParallel
from models.tensor_parallel import TensorParallel

BATCH, SEQ, HIDDEN, VOCAB, CP, TP = 3, 16, 32, 67, 2, 2
TINY = {"gpt": dict(name="gpt", num_layers=2, hidden_size=HIDDEN, num_heads=4, seq_len=SEQ, vocab_size=VOCAB),
        "llama": dict(name="llama", num_layers=2, hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, ffn_hidden_size=40,
                      seq_len=SEQ, vocab_size=VOCAB)}


class StandInGroup:
    """Where a process group would go; nothing on the meta device communicates."""


def tensor_parallel(kind: str) -> TensorParallel | None:
    return None if kind == "cp" else TensorParallel(StandInGroup(), rank=1, size=TP, sequence_parallel=kind == "sp")


@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("kind, boundary_seq, vocab", [("cp", SEQ // CP, VOCAB), ("tp", SEQ // CP, 34),
                                                       ("sp", SEQ // (CP * TP), 34)])
def test_stage_boundaries_hold_the_ranks_part_of_its_zigzag_shard(name, kind, boundary_seq, vocab):
    model = build_model(TINY[name], seed=0, tp=tensor_parallel(kind), cp=ContextParallel(StandInGroup(), 1, CP))
    with torch.device("meta"):
        layers = model.build()
        x = torch.zeros(BATCH, SEQ // CP, dtype=torch.long)   # the tokens of the rank's zigzag shard
        shapes = []
        for i in range(model.num_layers):
            x = layers[i](x)
            shapes.append(tuple(x.shape))
        loss = model.loss_fn(x, torch.zeros(BATCH, SEQ // CP, dtype=torch.long))
    assert shapes[:-1] == [(BATCH, boundary_seq, HIDDEN)] * (model.num_layers - 1)
    assert shapes[-1] == (BATCH, SEQ // CP, vocab) and loss.shape == ()
