"""``python -m pipedream.data.prepare tokenizer=DIR_OR_FILE input=FILE_OR_FOLDER out=DIR [val_fraction=0.05]``:
tokenizes text into the ``data=token_bin`` layout (``train.bin``, ``val.bin``) with a ``meta.json``
recording the dtype, the vocabulary size, the tokenizer and the token counts.

The tokenizer is a Hugging Face ``tokenizer.json`` (the file, or a folder holding it; needs the
``tokenizers`` package) or the name of a ``tiktoken`` encoding already in tiktoken's local cache.
Nothing is downloaded. Each input file is one document: the tokenizer's EOS token follows every
document (none is found: the encoding of "\\n\\n" separates them, as ``data=text_file`` does); no BOS
and no post-processor tokens (a BERT tokenizer's [CLS]/[SEP]) are added. Text is read as UTF-8
(undecodable bytes become U+FFFD) and tokenized in chunks that end at line ends, so a huge file
never sits in memory whole; the last ``val_fraction`` of the tokens is the validation split.
"""
from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, TextIO

import numpy as np

from pipedream.data.corpora import META, token_dtype_for
from pipedream.errors import REFUSED_EXIT, ConfigError, unknown_key_problem

USAGE = ("usage: python -m pipedream.data.prepare tokenizer=DIR_OR_FILE input=FILE_OR_FOLDER out=DIR "
         "[val_fraction=0.05]")
KEYS = ("tokenizer", "input", "out", "val_fraction")
CHUNK_BYTES = 1 << 20       # text tokenized per call, cut at a line end
REPORT_BYTES = 64 << 20     # off a terminal: one progress line per this much input
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|end_of_text|>")
SEPARATOR = "\n\n"          # between documents when the tokenizer has no EOS


@dataclass(frozen=True)
class TextTokenizer:
    encode: Callable[[str], list[int]]
    vocab_size: int
    eos_id: int | None
    source: str


def _hf_eos(tokenizer, folder: Path | None) -> int | None:
    """The EOS id: the folder's tokenizer_config.json ``eos_token`` when it names one, else the first
    usual EOS spelling the vocabulary holds."""
    names = list(EOS_NAMES)
    config = folder / "tokenizer_config.json" if folder else None
    if config is not None and config.is_file():
        with contextlib.suppress(OSError, ValueError):
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if isinstance(eos, str):
                names.insert(0, eos)
    return next((tokenizer.token_to_id(name) for name in names if tokenizer.token_to_id(name) is not None), None)


def hf_tokenizer(path: Path) -> TextTokenizer:
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"tokenizer={str(path)!r} holds no tokenizer.json: give a tokenizer.json file or a folder "
                          f"holding one (e.g. a saved Hugging Face tokenizer)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(f"tokenizer={str(path)!r} needs the tokenizers package: pip install .[hf]") from None
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as error:   # the Rust side raises plain Exceptions for a malformed file
        raise ConfigError(f"tokenizer file {str(file)!r} is not a tokenizers tokenizer.json "
                          f"({str(error).splitlines()[0] if str(error) else type(error).__name__}): "
                          f"save one with Tokenizer.save or PreTrainedTokenizerFast.save_pretrained") from None
    return TextTokenizer(lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
                         tokenizer.get_vocab_size(with_added_tokens=True),
                         _hf_eos(tokenizer, path if path.is_dir() else None), str(file.resolve()))


class NotCached(Exception):
    """tiktoken would have to download its encoding file."""


def _refuse_download(*_args, **_kwargs):
    raise NotCached


def tiktoken_tokenizer(name: str) -> TextTokenizer:
    try:
        import tiktoken
        import tiktoken.load
    except ImportError:
        raise ConfigError(f"tokenizer={name!r} is no file or folder, and tiktoken (for its encodings by name) is not "
                          f"installed: give a local tokenizer.json, or pip install tiktoken") from None
    fetch = tiktoken.load.read_file   # what tiktoken calls for a file missing from its cache
    tiktoken.load.read_file = _refuse_download
    try:
        encoding = tiktoken.get_encoding(name)
    except NotCached:
        raise ConfigError(f"tokenizer={name!r}: tiktoken's encoding file is not in its local cache and nothing is "
                          f"downloaded: fetch it once elsewhere into TIKTOKEN_CACHE_DIR, or give a local "
                          f"tokenizer.json") from None
    except ValueError as error:
        raise ConfigError(f"tokenizer={name!r} is no file or folder, nor a tiktoken encoding ({error})") from None
    finally:
        tiktoken.load.read_file = fetch
    return TextTokenizer(encoding.encode_ordinary, encoding.n_vocab, encoding.eot_token, f"tiktoken:{name}")


def load_tokenizer(spec: str) -> TextTokenizer:
    path = Path(spec).expanduser()
    if path.exists():
        return hf_tokenizer(path)
    if "/" in spec or spec.endswith(".json"):
        raise ConfigError(f"tokenizer={spec!r} does not exist: give a tokenizer.json file or a folder holding one "
                          f"(nothing is downloaded)")
    return tiktoken_tokenizer(spec)


def input_files(spec: str) -> list[Path]:
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(f"input={spec!r} does not exist: give a text file or a folder of them")
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"input={spec!r} is an empty folder: give a text file or a folder of them")
    if sum(p.stat().st_size for p in files) == 0:
        raise ConfigError(f"input={spec!r} holds no text (0 bytes): give a file (or folder) with text")
    return files


def text_chunks(stream: BinaryIO) -> Iterator[tuple[str, int]]:
    """(text, bytes read) of about CHUNK_BYTES each, ending at line ends (never inside a character)."""
    lines, size = [], 0
    for line in stream:
        lines.append(line)
        size += len(line)
        if size >= CHUNK_BYTES:
            yield b"".join(lines).decode("utf-8", errors="replace"), size
            lines, size = [], 0
    if lines:
        yield b"".join(lines).decode("utf-8", errors="replace"), size


def is_terminal(stream: TextIO) -> bool:
    """As the trainer's bar: carriage-return frames only on a terminal, never into a pipe or a log."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):   # a replaced or closed stream
        return False


class Progress:
    """A tqdm bar on a terminal; in a log one line per REPORT_BYTES of input."""

    def __init__(self, total_bytes: int, stream: TextIO):
        from tqdm import tqdm

        self.total, self.done, self.reported, self.stream = total_bytes, 0, 0, stream
        self.bar = tqdm(total=total_bytes, desc="tokenize", unit="B", unit_scale=True, file=stream,
                        disable=not is_terminal(stream))

    def update(self, read: int, tokens: int) -> None:
        self.done += read
        self.bar.update(read)
        if self.bar.disable and self.done - self.reported >= REPORT_BYTES:
            self.reported = self.done
            self.stream.write(f"prepare: {self.done / 2**20:.0f} of {self.total / 2**20:.0f} MiB tokenized, "
                              f"{tokens} tokens\n")
            self.stream.flush()

    def close(self) -> None:
        self.bar.close()


def tokenize_files(files: list[Path], tokenizer: TextTokenizer, out: BinaryIO, dtype: str) -> int:
    """Writes every file's tokens, each file followed by the EOS (or SEPARATOR), to ``out``; returns the count."""
    ending = [tokenizer.eos_id] if tokenizer.eos_id is not None else tokenizer.encode(SEPARATOR)
    progress = Progress(sum(p.stat().st_size for p in files), sys.stderr)
    count = 0
    try:
        for index, file in enumerate(files):
            with file.open("rb") as stream:
                for text, read in text_chunks(stream):
                    ids = np.asarray(tokenizer.encode(text), dtype=dtype)
                    out.write(ids.tobytes())
                    count += len(ids)
                    progress.update(read, count)
            if tokenizer.eos_id is not None or index < len(files) - 1:
                out.write(np.asarray(ending, dtype=dtype).tobytes())
                count += len(ending)
    finally:
        progress.close()
    return count


def split_tokens(tokens: Path, out: Path, dtype: str, val_fraction: float, input_spec: str) -> tuple[int, int]:
    """Cuts the token file into ``train.bin`` (first part) and ``val.bin`` (the last ``val_fraction``)."""
    itemsize = np.dtype(dtype).itemsize
    total = tokens.stat().st_size // itemsize
    cut = int(total * (1.0 - val_fraction))   # as data=token_bin splits one file
    if cut == 0 or cut == total:
        tokens.unlink()
        raise ConfigError(f"input={input_spec!r} gives {total} tokens, too few to split with val_fraction="
                          f"{val_fraction:g} (train {cut}, validation {total - cut}): give more text or change "
                          f"val_fraction")
    np.memmap(tokens, dtype=dtype, mode="r")[cut:].tofile(out / "val.bin")
    with tokens.open("r+b") as stream:
        stream.truncate(cut * itemsize)
    tokens.replace(out / "train.bin")
    return cut, total - cut


def prepare(tokenizer_spec: str, input_spec: str, out: Path, val_fraction: float = 0.05) -> dict:
    """Writes train.bin, val.bin and meta.json under ``out``; returns the meta record."""
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction={val_fraction:g} must be in (0, 1): the validation split's share, e.g. 0.05")
    files = input_files(input_spec)
    tokenizer = load_tokenizer(tokenizer_spec)
    dtype = token_dtype_for(tokenizer.vocab_size)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={str(out)!r} is a file, not a folder: give a folder for train.bin, val.bin, {META}")
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "tokens.partial"
    with partial.open("wb") as stream:
        tokenize_files(files, tokenizer, stream, dtype)
    train, val = split_tokens(partial, out, dtype, val_fraction, input_spec)
    meta = {"format": "token_bin", "dtype": dtype, "vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer.source,
            "eos_id": tokenizer.eos_id, "document_end": "eos" if tokenizer.eos_id is not None else SEPARATOR,
            "input": str(Path(input_spec).expanduser().resolve()), "files": len(files), "val_fraction": val_fraction,
            "tokens": {"train": train, "val": val}}
    (out / META).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return meta


def main(argv: list[str]) -> int:
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    unknown = [k for k in args if k not in KEYS]
    if unknown:
        print(f"error: {unknown_key_problem(unknown[0], KEYS, 'pipedream.data.prepare')}", file=sys.stderr)
        return REFUSED_EXIT
    if any("=" not in a for a in argv) or not all(k in args for k in KEYS[:3]):
        print(USAGE, file=sys.stderr)
        return REFUSED_EXIT
    try:
        try:
            val_fraction = float(args.get("val_fraction", 0.05))
        except ValueError:
            raise ConfigError(f"val_fraction={args['val_fraction']} is not a number: give a share in (0, 1), "
                              f"e.g. 0.05") from None
        meta = prepare(args["tokenizer"], args["input"], Path(args["out"]).expanduser(), val_fraction)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return REFUSED_EXIT
    out = Path(args["out"])
    print(f"wrote {out / 'train.bin'} ({meta['tokens']['train']} tokens), {out / 'val.bin'} "
          f"({meta['tokens']['val']} tokens), {out / META}: {meta['dtype']}, vocabulary {meta['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
