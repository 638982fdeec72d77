"""The raw material of the language-model corpora, torch-free (the pre-launch checks read it too):
byte-level text (the stdlib docs, text files) and ``token_bin`` files with their optional
``meta.json`` (written by ``python -m pipedream.data.prepare``)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipedream.errors import ConfigError

BYTE_VOCAB = 256             # byte-level tokens run 0..255
META = "meta.json"
DTYPES = ("uint16", "uint32")
UINT16_VOCAB = 1 << 16       # ids 0..65535 fit two bytes


def encode_bytes(text: str) -> np.ndarray:
    """Byte-level tokenizer: every UTF-8 byte is a token (vocabulary of 256)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def pydoc_text() -> str:
    from pydoc_data.topics import topics  # ~460 KB of English shipped with CPython
    return "\n\n".join(topics[key] for key in sorted(topics))


def text_files(path: Path) -> list[Path]:
    """A text file, or a folder's files read recursively, sorted by path."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        if not files:
            raise ConfigError(f"data.path={str(path)!r} is an empty folder: point it at a text file or a folder of them")
        return files
    return [path]


def read_text_path(path: Path) -> str:
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in text_files(path))


def token_dtype_for(vocab_size: int) -> str:
    """The narrowest token dtype holding every id below ``vocab_size``."""
    return "uint16" if vocab_size <= UINT16_VOCAB else "uint32"


@dataclass(frozen=True)
class TokenMeta:
    """What a token_bin folder's ``meta.json`` records; without one, raw uint16 ids of unknown vocabulary."""

    dtype: str = "uint16"
    vocab_size: int | None = None
    source: Path | None = None   # the meta.json read

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize


def meta_path(data_path: Path) -> Path:
    """A folder's ``meta.json``; for one .bin file, the ``meta.json`` beside it."""
    return (data_path if data_path.is_dir() else data_path.parent) / META


def read_token_meta(data_path: Path) -> TokenMeta:
    path = meta_path(data_path)
    if not path.is_file():
        return TokenMeta()
    try:
        record: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ConfigError(f"{path} is not readable JSON ({error}): rewrite it with python -m pipedream.data.prepare, "
                          f"or remove it to read the .bin files as raw uint16") from None
    dtype, vocab = (record.get("dtype", "uint16"), record.get("vocab_size")) if isinstance(record, dict) else (None, None)
    if dtype not in DTYPES:
        raise ConfigError(f"{path} records dtype={dtype!r}: token_bin files are {' or '.join(DTYPES)}; "
                          f"fix the file or re-tokenise with python -m pipedream.data.prepare")
    if vocab is not None and (not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1):
        raise ConfigError(f"{path} records vocab_size={vocab!r}: it must be a positive integer (the tokenizer's "
                          f"vocabulary size); fix the file or re-tokenise")
    return TokenMeta(dtype, vocab, path)


def open_tokens(path: Path, meta: TokenMeta) -> np.ndarray:
    """The file's tokens, memory-mapped (an empty file gives an empty array)."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=meta.dtype)
    return np.memmap(path, dtype=meta.dtype, mode="r")
