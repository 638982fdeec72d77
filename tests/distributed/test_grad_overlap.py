"""Data-parallel gradient buckets reduced during the backward (``train.overlap_grad_reduce``)
train exactly as single-process training does, on (pp, dp) = (2, 2), with overlap on (many small
buckets, tied weights across stages, a zero-bubble schedule's W actions, accumulation over m
micro-batches, tensor-parallel layers at (pp, tp, dp) = (1, 2, 2)) and off; the trace shows each bucket's all-reduce, launched before SYNC_GRADS."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.training_harness import TINY_GPT, assert_matches_reference, merge_params, reference_training, train_rank
from tests.support.workers import run_workers

BASE = TINY_GPT + ["train.steps=3", "parallel.dp=2", "optim=sgd", "train.lr=0.05",
                   "model.tie_embeddings=true", "train.grad_bucket_mb=0.002"]   # ~2 KB: several buckets per stage
RUNS = {
    "overlap": ["schedule=1f1b", "parallel.pp=2", "train.overlap_grad_reduce=true", "trace.enabled=true", "trace.steps=[3]"],
    "blocking": ["schedule=1f1b", "parallel.pp=2", "train.overlap_grad_reduce=false"],
    "zbv": ["schedule=zbv", "parallel.pp=2", "train.overlap_grad_reduce=true"],
    # tensor-parallel Linears accumulate their weight gradients themselves: the hooks must see them
    "tp": ["schedule=1f1b", "parallel.pp=1", "parallel.tp=2", "model.vocab_size=255"],
}


@pytest.mark.slow
def test_overlapped_buckets_match_single_process(tmp_path: Path) -> None:
    runs = [(BASE + extra, str(tmp_path / name)) for name, extra in RUNS.items()]
    per_rank = run_workers(train_rank, 4, runs)
    for index, (name, extra) in enumerate(RUNS.items()):
        result = merge_params([rank_results[index] for rank_results in per_rank])
        assert_matches_reference({"params": result, "losses": per_rank[0][index]["losses"]},
                                 reference_training(BASE + extra))
    trace = json.loads((tmp_path / "overlap" / "trace" / "trace.json").read_text())["traceEvents"]
    for rank in range(4):
        boxes = [e for e in trace if e.get("cat") == "grad_reduce" and e["pid"] == rank]
        sync = next(e for e in trace if e.get("cat") == "sync" and e["pid"] == rank)
        assert len(boxes) >= 3 and all(e["tid"] == 1 for e in boxes)
        assert min(e["ts"] for e in boxes) < sync["ts"]   # launched inside the backward, not at the sync
