"""Training data: byte-level corpora (stdlib docs, text files), token files (uint16, or the dtype
their meta.json records), synthetic data, and the datasets built from them.

Nothing is downloaded: the default corpus is the documentation text that ships with Python.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.family import IMAGES, MASKED_LM, TEACHER_REGRESSION
from models.registry import model_family
from models.families.transformer_facts import OPTIONAL_KEYS, mlm_mask_id, option

from pipedream.data.corpora import encode_bytes, open_tokens, pydoc_text, read_text_path, read_token_meta
from pipedream.data.plugins import plugin_datasets
from pipedream.errors import ConfigError


def _existing(path_value: Any, what: str) -> Path:
    if path_value in (None, "", "???"):
        raise ConfigError(f"data.path is not set: {what} needs data.path=/path/to/file")
    path = Path(str(path_value)).expanduser()
    if not path.exists():
        raise ConfigError(f"data.path={str(path)!r} does not exist: give an existing {what}")
    return path


def _split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:cut], tokens[cut:]


def load_token_corpus(data_cfg: Any, vocab_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Returns (train, validation) token arrays for a language model."""
    name = data_cfg["name"]
    val_fraction = float(data_cfg["val_fraction"])
    if name == "pydoc":
        train, val = _split(encode_bytes(pydoc_text()), val_fraction)
    elif name == "text_file":
        train, val = _split(encode_bytes(read_text_path(_existing(data_cfg.get("path"), "text file or folder"))),
                            val_fraction)
    elif name == "token_bin":
        path = _existing(data_cfg.get("path"), "token .bin file or a folder with train.bin and val.bin")
        meta = read_token_meta(path)
        if path.is_dir():
            train, val = open_tokens(path / "train.bin", meta), open_tokens(path / "val.bin", meta)
        else:
            train, val = _split(open_tokens(path, meta), val_fraction)
    elif name == "synthetic":
        rng = np.random.default_rng(seed)
        total = int(data_cfg["num_samples"]) * 64
        train, val = _split(rng.integers(0, vocab_size, total).astype(np.uint16), val_fraction)
    else:
        raise ConfigError(f"data={name!r} is unknown: choose pydoc, text_file, token_bin or synthetic")
    if name != "synthetic":
        for part in (train, val):
            if len(part) and int(part.max()) >= vocab_size:
                raise ConfigError(f"data holds token id {int(part.max())} >= model.vocab_size={vocab_size}: "
                                  f"raise model.vocab_size or re-tokenise")
    return train, val


class TokenWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens: (input, next-token target)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.count = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = torch.from_numpy(np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        return window[:-1], window[1:]


class MaskedLanguageModeling(torch.utils.data.Dataset):
    """BERT's masked-language-model corruption of another dataset's input windows.

    Exactly ``round(mask_fraction * seq_len)`` positions (at least one) per sample become targets:
    80% of them are replaced by [MASK], 10% by a random non-[MASK] token, 10% kept. Targets are the
    original ids there and -100 elsewhere. The choice depends only on (seed, index), so every rank
    and the single-process reference see the same masks; a fixed count per sample also makes the
    mean over micro-batch means equal the mean over the whole batch."""

    IGNORE_INDEX = -100

    def __init__(self, windows: torch.utils.data.Dataset, vocab_size: int, seed: int,
                 mask_fraction: float = OPTIONAL_KEYS["mask_fraction"]):
        if not 0.0 < mask_fraction <= 1.0:
            raise ConfigError(f"model.mask_fraction={mask_fraction} must be in (0, 1]: BERT uses 0.15")
        self.windows, self.seed, self.mask_fraction = windows, seed, mask_fraction
        self.mask_id = mlm_mask_id(vocab_size)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.windows[index][0]
        rng = np.random.default_rng([self.seed, 0x4D4C4D, index])  # "MLM": a stream of its own
        count = max(1, round(self.mask_fraction * len(tokens)))
        positions = torch.from_numpy(rng.choice(len(tokens), count, replace=False))
        action = torch.from_numpy(rng.random(count))
        random_tokens = torch.from_numpy(rng.integers(0, self.mask_id, count))
        targets = torch.full_like(tokens, self.IGNORE_INDEX)
        targets[positions] = tokens[positions]
        inputs = tokens.clone()
        inputs[positions[action < 0.8]] = self.mask_id
        swap = (action >= 0.8) & (action < 0.9)
        inputs[positions[swap]] = random_tokens[swap]
        return inputs, targets


class TeacherRegression(torch.utils.data.Dataset):
    """x ~ N(0, I), y = sin(x W) for a fixed random W: a smooth target an MLP can fit."""

    def __init__(self, num_samples: int, width: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, width, generator=generator)
        teacher = torch.randn(width, width, generator=generator) / width ** 0.5
        self.y = torch.sin(self.x @ teacher)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def build_datasets(model_cfg: Any, data_cfg: Any, seed: int) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    if data_cfg.get("_target_") is not None:   # a plugin (docs/models.md)
        return plugin_datasets(data_cfg, seed)
    data_kind = model_family(model_cfg["name"]).data_kind
    if data_kind == IMAGES:
        from pipedream.data.images import vision_datasets
        return vision_datasets(model_cfg, data_cfg, seed)
    if data_kind == TEACHER_REGRESSION:
        if data_cfg["name"] != "synthetic":
            raise ConfigError(f"model={model_cfg['name']} trains on synthetic regression data, not data={data_cfg['name']}: "
                              f"use data=synthetic")
        total = int(data_cfg["num_samples"])
        full = TeacherRegression(total, int(model_cfg["hidden_size"]), seed)
        cut = int(total * (1.0 - float(data_cfg["val_fraction"])))
        return (torch.utils.data.Subset(full, range(cut)), torch.utils.data.Subset(full, range(cut, total)))
    vocab_size = int(option(model_cfg, "vocab_size"))
    seq_len = int(model_cfg["seq_len"])
    if data_kind == MASKED_LM:
        return _mlm_datasets(model_cfg, data_cfg, vocab_size, seq_len, seed)
    train, val = load_token_corpus(data_cfg, vocab_size, seed)
    return TokenWindows(train, seq_len), TokenWindows(val, seq_len)


def _mlm_datasets(model_cfg: Any, data_cfg: Any, vocab_size: int, seq_len: int, seed: int
                  ) -> tuple[MaskedLanguageModeling, MaskedLanguageModeling]:
    mask_id = mlm_mask_id(vocab_size)
    synthetic = data_cfg["name"] == "synthetic"
    train, val = load_token_corpus(data_cfg, mask_id if synthetic else vocab_size, seed)  # synthetic: no [MASK]
    for part in (train, val):
        if len(part) and int(part.max()) >= mask_id:
            raise ConfigError(f"data holds token id {int(part.max())} but model={model_cfg['name']} reserves id {mask_id} "
                              f"(model.vocab_size - 1) for [MASK]: raise model.vocab_size to {int(part.max()) + 2}")
    fraction = float(option(model_cfg, "mask_fraction"))
    return (MaskedLanguageModeling(TokenWindows(train, seq_len), vocab_size, seed, fraction),
            MaskedLanguageModeling(TokenWindows(val, seq_len), vocab_size, seed + 1, fraction))


