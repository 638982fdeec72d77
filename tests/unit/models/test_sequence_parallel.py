"""Sequence parallelism's layer shapes, on the meta device (no process group needed there): the
regions between the tensor-parallel GEMMs hold 1/t of the sequence (models/tensor_parallel/sequence.py).
Values are checked against single-process training in tests/distributed/test_tensor_parallel_training.py."""
from __future__ import annotations

import torch

from models import build_model
from models.tensor_parallel import TensorParallel
from models.tensor_parallel.sequence import SequenceParallelLayerNorm, sequence_range

CFG = {"name": "gpt", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_len": 16, "vocab_size": 50,
       "tie_embeddings": True, "dropout": 0.0}


def _meta_layers(sequence_parallel: bool, rank: int = 0):
    tp = TensorParallel(group=object(), rank=rank, size=2, sequence_parallel=sequence_parallel)
    with torch.device("meta"):
        return tp, list(build_model(CFG, tp=tp).build().values())


def test_the_residual_stream_holds_this_ranks_part_of_the_sequence():
    _, layers = _meta_layers(True)
    with torch.device("meta"):
        x = torch.zeros(3, 16, dtype=torch.long)
    shapes = []
    for layer in layers:
        x = layer(x)
        shapes.append(tuple(x.shape))
    assert shapes == [(3, 8, 32), (3, 8, 32), (3, 8, 32), (3, 16, 25)]   # logits: whole sequence, 1/t of the vocabulary


def test_without_sequence_parallelism_the_stream_is_whole():
    _, layers = _meta_layers(False)
    with torch.device("meta"):
        x = layers[1](layers[0](torch.zeros(3, 16, dtype=torch.long)))
    assert tuple(x.shape) == (3, 16, 32)


def test_layer_norms_are_wrapped_and_keep_their_parameter_names():
    _, plain = _meta_layers(False)
    _, sharded = _meta_layers(True)
    assert isinstance(sharded[1].ln1, SequenceParallelLayerNorm)
    for dense, seq in zip(plain, sharded):
        assert [n for n, _ in dense.named_parameters()] == [n for n, _ in seq.named_parameters()]


def test_each_rank_takes_its_own_positions():
    assert [sequence_range(16, TensorParallel(group=object(), rank=r, size=4)) for r in range(4)] == \
        [(0, 4), (4, 8), (8, 12), (12, 16)]
