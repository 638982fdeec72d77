"""Checks a run's data files before any process starts (the launcher) and on rank 0 of a run started
with torchrun directly: every split must hold at least one sample of ``seq_len + 1`` tokens, token
files must be whole uint16 arrays with ids below the vocabulary, text should be UTF-8. Torch-free."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from models.families.transformer_facts import option

from pipedream.errors import ConfigError

TOKEN_BYTES = 2          # uint16
SCAN_TOKENS = 1 << 24    # token ids checked per chunk (32 MB)


def _text_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        if not files:
            raise ConfigError(f"data.path={str(path)!r} is an empty folder: point it at a text file or a folder of them")
        return files
    return [path]


def text_token_count(path: Path) -> tuple[int, int]:
    """(byte tokens after decoding, bytes replaced because they are not UTF-8), as data.py reads the text."""
    files = _text_files(path)
    tokens = 2 * (len(files) - 1)   # the "\n\n" between files
    replaced = 0
    for file in files:
        raw = file.read_bytes()
        try:
            raw.decode("utf-8")
            bad = 0
        except UnicodeDecodeError:   # each undecodable byte becomes U+FFFD: 3 bytes instead of 1
            text = raw.decode("utf-8", errors="surrogateescape")
            bad = sum(1 for char in text if "\udc80" <= char <= "\udcff")
        replaced += bad
        tokens += len(raw) + 2 * bad
    return tokens, replaced


def _need(count: int, seq_len: int, what: str, fix: str) -> None:
    if count < seq_len + 1:
        raise ConfigError(f"{what} holds {count} tokens, fewer than one sample of data.seq_len+1 = {seq_len + 1}: {fix}")


def _split_sizes(total: int, val_fraction: float) -> tuple[int, int]:
    cut = int(total * (1.0 - val_fraction))   # as data._split
    return cut, total - cut


def check_token_file(path: Path, vocab_size: int) -> int:
    """Token count of a uint16 file; refuses odd sizes and ids >= ``vocab_size``."""
    size = path.stat().st_size
    if size % TOKEN_BYTES:
        raise ConfigError(f"data.path file {str(path)!r} holds {size} bytes, an odd count: token_bin files are "
                          f"uint16 arrays (2 bytes a token), so it is truncated or not a token file; re-tokenise it")
    count = size // TOKEN_BYTES
    if count:
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        largest = max(int(tokens[start:start + SCAN_TOKENS].max()) for start in range(0, count, SCAN_TOKENS))
        if largest >= vocab_size:
            raise ConfigError(f"data.path file {str(path)!r} holds token id {largest} >= model.vocab_size="
                              f"{vocab_size}: raise model.vocab_size to at least {largest + 1} or re-tokenise")
    return count


def check_data(data_cfg: Any, model_cfg: Any, seq_len: int | None) -> list[str]:
    """Raises ConfigError for data the run cannot use; returns warnings (one line each)."""
    name = data_cfg.get("name")   # a data plugin (data._target_) has none: its own checks run in plugins
    if name not in ("text_file", "token_bin") or seq_len is None:
        return []
    path = Path(str(data_cfg["path"])).expanduser()
    val_fraction = float(data_cfg["val_fraction"])
    fix = "give more data, or lower data.seq_len"
    vocab_size = int(option(model_cfg, "vocab_size"))
    if name == "text_file":
        total, replaced = text_token_count(path)
        if total == 0:
            raise ConfigError(f"data.path={str(path)!r} is empty: give a file (or folder) with text")
        train, val = _split_sizes(total, val_fraction)
        _need(train, seq_len, f"the training split of data.path={str(path)!r} ({total} bytes, "
                              f"data.val_fraction={val_fraction:g})", fix)
        _need(val, seq_len, f"the validation split of data.path={str(path)!r}", f"{fix} or raise data.val_fraction")
        if replaced:
            return [f"data.path={str(path)!r} is not valid UTF-8 text: {replaced} bytes are read as U+FFFD "
                    f"(replaced); check that it is the text you meant"]
        return []
    if path.is_dir():
        for part in ("train.bin", "val.bin"):
            if not (path / part).is_file():
                raise ConfigError(f"data.path={str(path)!r} has no {part}: a token_bin folder holds train.bin and "
                                  f"val.bin (nanoGPT's layout); or point data.path at one .bin file")
        for part in ("train.bin", "val.bin"):
            _need(check_token_file(path / part, vocab_size), seq_len, f"{path / part}", fix)
        return []
    total = check_token_file(path, vocab_size)
    if total == 0:
        raise ConfigError(f"data.path={str(path)!r} is empty: give a uint16 token file")
    train, val = _split_sizes(total, val_fraction)
    _need(train, seq_len, f"the training split of data.path={str(path)!r}", fix)
    _need(val, seq_len, f"the validation split of data.path={str(path)!r}", f"{fix} or raise data.val_fraction")
    return []
