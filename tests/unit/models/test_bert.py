"""BERT: masked-language-model data, the model's shape and attention, and that it learns."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models import TRAINABLE_MODELS, build_model
from pipedream.data.datasets import MaskedLanguageModeling, TokenWindows, build_datasets
from pipedream.data.batching import GlobalBatchOrder, collate
from pipedream.errors import ConfigError

BERT_TINY = {"name": "bert", "num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_len": 64, "vocab_size": 256}


def _mlm(seed: int = 0) -> MaskedLanguageModeling:
    tokens = np.random.default_rng(0).integers(0, 255, 40 * 64 + 1).astype(np.uint16)
    return MaskedLanguageModeling(TokenWindows(tokens, 64), vocab_size=256, seed=seed)


def test_masks_are_deterministic_per_index_and_seed():
    first, again, other = _mlm(), _mlm(), _mlm(seed=1)
    for index in (0, 7, 39):
        assert all(torch.equal(a, b) for a, b in zip(first[index], again[index]))
    assert not all(torch.equal(first[i][1], other[i][1]) for i in range(5))
    assert not torch.equal(first[0][1] != -100, first[1][1] != -100)  # positions differ between samples


def test_mask_proportions_and_targets():
    data = _mlm()
    counts = {"target": 0, "mask": 0, "random": 0, "kept": 0, "positions": 0}
    for index in range(len(data)):
        inputs, targets = data[index]
        original = data.windows[index][0]
        chosen = targets != -100
        assert chosen.sum() == round(0.15 * 64)                       # exactly 15% of positions
        assert torch.equal(targets[chosen], original[chosen])          # targets are the true ids
        assert torch.equal(inputs[~chosen], original[~chosen])         # the rest untouched
        counts["positions"] += len(targets)
        counts["target"] += int(chosen.sum())
        counts["mask"] += int((inputs[chosen] == 255).sum())
        counts["kept"] += int((inputs[chosen] == original[chosen]).sum())
        counts["random"] += int(((inputs[chosen] != 255) & (inputs[chosen] != original[chosen])).sum())
    share = {k: counts[k] / counts["target"] for k in ("mask", "random", "kept")}
    assert share["mask"] == pytest.approx(0.8, abs=0.05)
    assert share["random"] == pytest.approx(0.1, abs=0.04)  # a random token may equal the original
    assert share["kept"] == pytest.approx(0.1, abs=0.04)


def test_build_datasets_returns_mlm_for_bert_and_rejects_the_mask_id_in_data(tmp_path):
    train, val = build_datasets(BERT_TINY, {"name": "pydoc", "val_fraction": 0.1}, seed=3)
    assert isinstance(train, MaskedLanguageModeling) and isinstance(val, MaskedLanguageModeling)
    inputs, targets = collate(train, [0, 1])
    assert inputs.shape == targets.shape == (2, 64) and int(inputs.max()) <= 255
    synthetic, _ = build_datasets(BERT_TINY, {"name": "synthetic", "num_samples": 64, "val_fraction": 0.1}, seed=3)
    assert int(synthetic.windows.tokens.max()) < 255
    folder = tmp_path / "bins"
    folder.mkdir()
    np.full(1000, 255, dtype=np.uint16).tofile(folder / "train.bin")
    np.full(100, 7, dtype=np.uint16).tofile(folder / "val.bin")
    with pytest.raises(ConfigError, match="reserves id 255"):
        build_datasets(BERT_TINY, {"name": "token_bin", "path": str(folder), "val_fraction": 0.1}, seed=3)


def test_bert_layers_attention_is_bidirectional_and_head_tied():
    assert "bert" in TRAINABLE_MODELS
    model = build_model(BERT_TINY, seed=0)
    assert model.num_layers == 4 and model.tied == (((0, "wte.weight"), (3, "weight")),)
    network = model.build_sequential().eval()
    assert network[3].weight is network[0].wte.weight
    x = torch.randint(0, 255, (1, 64))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % 255
    assert not torch.allclose(network(x)[0, 0], network(y)[0, 0])  # a later token changes the first output
    with pytest.raises(ConfigError, match="planner-only"):
        build_model({**BERT_TINY, "planner_only": True, "preset": "bert_large"})


def test_tiny_bert_mlm_loss_falls_on_pydoc():
    """40 AdamW steps of 16 windows: about 5.3 -> 3.3 nats per masked byte (uniform is 5.5)."""
    torch.manual_seed(0)
    model = build_model(BERT_TINY, seed=0)
    network = model.build_sequential()
    train, _ = build_datasets(BERT_TINY, {"name": "pydoc", "val_fraction": 0.1}, seed=0)
    order = GlobalBatchOrder(len(train), 16, seed=0)
    optimizer = torch.optim.AdamW(network.parameters(), lr=2e-3)
    losses = []
    for step in range(40):
        inputs, targets = collate(train, order.indices(step))
        loss = model.loss_fn(network(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert np.mean(losses[:5]) > 5.0 and np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.5, losses
