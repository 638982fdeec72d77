from __future__ import annotations

import numpy as np
import pytest

from pipedream.data.datasets import TokenWindows, build_datasets, encode_bytes, load_token_corpus
from pipedream.data.batching import GlobalBatchOrder, microbatches
from pipedream.errors import ConfigError


def decode_bytes(tokens) -> str:
    """The byte-level tokenizer's inverse."""
    return bytes(int(t) for t in tokens).decode("utf-8")


def test_byte_tokenizer_round_trip():
    text = "pipelines — naïve 1F1B"
    tokens = encode_bytes(text)
    assert tokens.max() < 256 and decode_bytes(tokens) == text


def test_pydoc_corpus_is_installed_and_split():
    train, val = load_token_corpus({"name": "pydoc", "val_fraction": 0.1}, 256, seed=0)
    assert len(train) > 300_000 and len(val) > 30_000
    assert abs(len(val) / (len(train) + len(val)) - 0.1) < 0.01


def test_text_folder_and_token_bin(tmp_path):
    (tmp_path / "a.txt").write_text("hello " * 100)
    (tmp_path / "b.txt").write_text("world " * 100)
    train, val = load_token_corpus({"name": "text_file", "path": str(tmp_path), "val_fraction": 0.5}, 256, 0)
    assert decode_bytes(train[:6]) == "hello "
    folder = tmp_path / "bins"
    folder.mkdir()
    np.arange(1000, dtype=np.uint16).tofile(folder / "train.bin")
    np.arange(100, dtype=np.uint16).tofile(folder / "val.bin")
    train, val = load_token_corpus({"name": "token_bin", "path": str(folder), "val_fraction": 0.1}, 1024, 0)
    assert len(train) == 1000 and int(val[-1]) == 99
    with pytest.raises(ConfigError, match="token id 999 >= model.vocab_size=256"):
        load_token_corpus({"name": "token_bin", "path": str(folder), "val_fraction": 0.1}, 256, 0)


def test_windows_are_next_token_pairs():
    windows = TokenWindows(np.arange(100, dtype=np.uint16), seq_len=8)
    x, y = windows[2]
    assert x.tolist() == list(range(16, 24)) and y.tolist() == list(range(17, 25))
    assert len(windows) == 12


def test_shards_are_disjoint_deterministic_and_cover_the_global_batch():
    order = GlobalBatchOrder(dataset_size=48, global_batch=12, seed=7)
    for step in range(8):  # two epochs
        shards = [order.shard(step, rank, 3) for rank in range(3)]
        assert sum(shards, []) == order.indices(step)
        assert len(set(sum(shards, []))) == 12  # disjoint
        assert shards == [GlobalBatchOrder(48, 12, 7).shard(step, rank, 3) for rank in range(3)]
    for epoch in range(2):
        seen = sum((order.indices(s) for s in range(4 * epoch, 4 * epoch + 4)), [])
        assert sorted(seen) == list(range(48))  # every sample once per epoch
    assert order.indices(0) != order.indices(4)  # reshuffled each epoch
    assert GlobalBatchOrder(48, 12, 8).indices(0) != order.indices(0)


def test_batches_wrap_across_epochs():
    order = GlobalBatchOrder(dataset_size=50, global_batch=12, seed=1)
    assert len(order.indices(4)) == 12  # positions 48..59 span epochs 0 and 1


def test_microbatches_split_a_shard():
    train, _ = build_datasets({"name": "mlp", "hidden_size": 4}, {"name": "synthetic", "num_samples": 64, "val_fraction": 0.1}, 0)
    parts = microbatches(train, list(range(8)), 2)
    assert len(parts) == 4 and parts[0][0].shape == (2, 4)


def test_each_epoch_is_drawn_once_and_reads_as_a_fresh_draw():
    # 10 samples in batches of 4: batches cross epoch boundaries; a fresh order has drawn nothing
    order = GlobalBatchOrder(dataset_size=10, global_batch=4, seed=3)
    for step in range(25):
        assert order.indices(step) == GlobalBatchOrder(10, 4, 3).indices(step)
        assert len(order._drawn) <= 2   # only the epochs a batch can still read
    assert order == GlobalBatchOrder(10, 4, 3)   # the drawn permutations are no part of its value
