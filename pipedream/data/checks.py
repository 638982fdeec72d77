"""Checks a run's data files before any process starts (the launcher) and on rank 0 of a run started
with torchrun directly: every split must hold at least one sample of ``seq_len + 1`` tokens, token
files must be whole arrays of their dtype (uint16, or as their meta.json says) with ids the model
can embed, byte-level corpora must fit the model's vocabulary, text should be UTF-8. Torch-free."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from models.family import MASKED_LM
from models.families.transformer_facts import mlm_mask_id, option
from models.registry import model_family

from pipedream.data.corpora import BYTE_VOCAB, TokenMeta, open_tokens, pydoc_text, read_token_meta, text_files
from pipedream.errors import ConfigError

SCAN_TOKENS = 1 << 24    # token ids checked per chunk


def text_token_count(path: Path) -> tuple[int, int, int]:
    """(byte tokens after decoding, bytes replaced because they are not UTF-8, the largest byte token),
    as data.py reads the text."""
    files = text_files(path)
    tokens = 2 * (len(files) - 1)   # the "\n\n" between files
    replaced, largest = 0, ord("\n") if len(files) > 1 else -1
    for file in files:
        raw = file.read_bytes()
        try:
            raw.decode("utf-8")
            bad = 0
        except UnicodeDecodeError:   # each undecodable byte becomes U+FFFD: 3 bytes instead of 1
            text = raw.decode("utf-8", errors="surrogateescape")
            bad = sum(1 for char in text if "\udc80" <= char <= "\udcff")
            raw = raw.decode("utf-8", errors="replace").encode("utf-8")
        replaced += bad
        tokens += len(raw)
        if raw:
            largest = max(largest, int(np.frombuffer(raw, dtype=np.uint8).max()))
    return tokens, replaced, largest


def _need(count: int, seq_len: int, what: str, fix: str) -> None:
    if count < seq_len + 1:
        raise ConfigError(f"{what} holds {count} tokens, fewer than one sample of data.seq_len+1 = {seq_len + 1}: {fix}")


def _split_sizes(total: int, val_fraction: float) -> tuple[int, int]:
    cut = int(total * (1.0 - val_fraction))   # as data._split
    return cut, total - cut


def _reserved_ids(model_cfg: Any) -> int:
    """Ids at the top of the vocabulary that data must not hold: a masked language model's [MASK]."""
    return 1 if model_family(model_cfg["name"]).data_kind == MASKED_LM else 0


def _refuse_ids(largest: int, what: str, model_cfg: Any, fix: str, needed: int | None = None) -> None:
    """Refuses data holding token id ``largest`` when the model cannot take it; ``needed`` is the
    vocabulary to suggest (default: just enough for ``largest``)."""
    vocab_size, reserved = int(option(model_cfg, "vocab_size")), _reserved_ids(model_cfg)
    limit = vocab_size - reserved
    if largest < limit:
        return
    bound = (f"model.vocab_size={vocab_size}" if not reserved else
             f"{mlm_mask_id(vocab_size)}, the [MASK] id of model={model_cfg['name']} (model.vocab_size - 1)")
    raise ConfigError(f"{what} holds token id {largest} >= {bound}: raise model.vocab_size to at least "
                      f"{(needed or largest + 1) + reserved} {fix}")


def _check_byte_corpus(largest: int, what: str, model_cfg: Any) -> None:
    """Byte-level tokens run 0..255: a smaller vocabulary fails on the first byte it lacks."""
    _refuse_ids(largest, f"{what} (byte-level tokens, 0..{BYTE_VOCAB - 1})", model_cfg,
                "(enough for every byte)", needed=BYTE_VOCAB)


def check_token_file(path: Path, meta: TokenMeta, model_cfg: Any) -> int:
    """Token count of a token file; refuses sizes that are not whole tokens and ids the model cannot take."""
    size = path.stat().st_size
    if size % meta.itemsize:
        shape = "an odd count" if meta.itemsize == 2 else f"not a multiple of {meta.itemsize}"
        recorded = f" as {meta.source} records" if meta.source else ""
        raise ConfigError(f"data.path file {str(path)!r} holds {size} bytes, {shape}: token_bin files are "
                          f"{meta.dtype} arrays ({meta.itemsize} bytes a token{recorded}), so it is truncated "
                          f"or not a token file; re-tokenise it")
    tokens = open_tokens(path, meta)
    if len(tokens):
        largest = max(int(tokens[start:start + SCAN_TOKENS].max()) for start in range(0, len(tokens), SCAN_TOKENS))
        _refuse_ids(largest, f"data.path file {str(path)!r}", model_cfg, "or re-tokenise")
    return len(tokens)


def check_recorded_vocab(meta: TokenMeta, model_cfg: Any) -> None:
    """A tokenizer's vocabulary larger than the model's: some of its ids could not be embedded."""
    vocab_size, reserved = int(option(model_cfg, "vocab_size")), _reserved_ids(model_cfg)
    if meta.vocab_size is not None and meta.vocab_size + reserved > vocab_size:
        mask = f" (model={model_cfg['name']} keeps one more id for [MASK])" if reserved else ""
        raise ConfigError(f"{meta.source} records a tokenizer vocabulary of {meta.vocab_size} tokens, more than "
                          f"model.vocab_size={vocab_size}{mask}: set model.vocab_size={meta.vocab_size + reserved} "
                          f"(or more), or re-tokenise with a smaller vocabulary")


def check_data(data_cfg: Any, model_cfg: Any, seq_len: int | None) -> list[str]:
    """Raises ConfigError for data the run cannot use; returns warnings (one line each)."""
    name = data_cfg.get("name")   # a data plugin (data._target_) has none: its own checks run in plugins
    if name not in ("pydoc", "text_file", "token_bin") or seq_len is None:
        return []
    if name == "pydoc":
        _check_byte_corpus(max(pydoc_text().encode("utf-8")), "data=pydoc", model_cfg)
        return []
    path = Path(str(data_cfg["path"])).expanduser()
    val_fraction = float(data_cfg["val_fraction"])
    fix = "give more data, or lower data.seq_len"
    if name == "text_file":
        total, replaced, largest = text_token_count(path)
        if total == 0:
            raise ConfigError(f"data.path={str(path)!r} is empty: give a file (or folder) with text")
        _check_byte_corpus(largest, f"data.path={str(path)!r}", model_cfg)
        train, val = _split_sizes(total, val_fraction)
        _need(train, seq_len, f"the training split of data.path={str(path)!r} ({total} bytes, "
                              f"data.val_fraction={val_fraction:g})", fix)
        _need(val, seq_len, f"the validation split of data.path={str(path)!r}", f"{fix} or raise data.val_fraction")
        if replaced:
            return [f"data.path={str(path)!r} is not valid UTF-8 text: {replaced} bytes are read as U+FFFD "
                    f"(replaced); check that it is the text you meant"]
        return []
    meta = read_token_meta(path)
    check_recorded_vocab(meta, model_cfg)
    if path.is_dir():
        for part in ("train.bin", "val.bin"):
            if not (path / part).is_file():
                raise ConfigError(f"data.path={str(path)!r} has no {part}: a token_bin folder holds train.bin and "
                                  f"val.bin (nanoGPT's layout); or point data.path at one .bin file")
        for part in ("train.bin", "val.bin"):
            _need(check_token_file(path / part, meta, model_cfg), seq_len, f"{path / part}", fix)
        return []
    total = check_token_file(path, meta, model_cfg)
    if total == 0:
        raise ConfigError(f"data.path={str(path)!r} is empty: give a {meta.dtype} token file")
    train, val = _split_sizes(total, val_fraction)
    _need(train, seq_len, f"the training split of data.path={str(path)!r}", fix)
    _need(val, seq_len, f"the validation split of data.path={str(path)!r}", f"{fix} or raise data.val_fraction")
    return []
