"""Token files as ``python -m pipedream.data.prepare`` writes them for a vocabulary over 65,536 ids:
uint32 with a meta.json. A GPT with such a vocabulary trains on them on two pipeline stages exactly
as single-process training does (fp32, the equality tolerance of the other tests)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.training_harness import TINY_GPT, assert_matches_reference, merge_params, reference_training, train_rank
from tests.support.workers import run_workers

VOCAB = 70_000


@pytest.mark.slow
def test_a_uint32_corpus_trains_a_large_vocabulary_like_one_process(tmp_path):
    folder = tmp_path / "tokens"
    folder.mkdir()
    ids = np.random.default_rng(0).integers(60_000, VOCAB, 600).astype(np.uint32)   # most above 65,535
    ids[:16] = np.arange(VOCAB - 16, VOCAB)                                          # the largest id too
    ids.tofile(folder / "train.bin")
    ids[:100].tofile(folder / "val.bin")
    (folder / "meta.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": VOCAB}))
    overrides = [*TINY_GPT, "model.num_layers=2", "model.hidden_size=16", f"model.vocab_size={VOCAB}",
                 "data=token_bin", f"data.path={folder}", "train.steps=2", "parallel.pp=2", "optim=sgd",
                 "train.lr=0.5"]
    per_rank = run_workers(train_rank, 2, [(overrides, str(tmp_path / "run"))])
    result = merge_params([rank_results[0] for rank_results in per_rank])
    reference = reference_training(overrides)
    assert result["0.wte.weight"].shape[0] == VOCAB
    assert_matches_reference({"params": result, "losses": per_rank[0][0]["losses"]}, reference)
    assert reference["losses"][1] < reference["losses"][0]   # and it learns
