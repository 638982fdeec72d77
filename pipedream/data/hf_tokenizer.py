"""The tokenizer a run's data was tokenized with, for a Hugging Face export: the ``tokenizer.json``
that ``meta.json`` (written by ``python -m pipedream.data.prepare``) names, and the
``tokenizer_config.json`` that makes ``AutoTokenizer`` load it with the data's BOS/EOS tokens."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class NoTokenizer(Exception):
    """Why the export holds no tokenizer (one line); the weights are exported all the same."""


@dataclass(frozen=True)
class RunTokenizer:
    """The tokenizer.json the run's data was tokenized with, and the tokenizer_config.json that makes
    ``AutoTokenizer`` load it with the data's special tokens."""
    file: Path
    config: dict[str, Any]
    bos_id: int | None
    eos_id: int | None


def data_meta(data_cfg: dict[str, Any]) -> tuple[dict[str, Any], Path]:
    """The ``meta.json`` that ``python -m pipedream.data.prepare`` wrote for the run's data, and its path."""
    from pipedream.data.corpora import meta_path
    if data_cfg.get("name") != "token_bin":
        name = data_cfg.get("name") or data_cfg.get("_target_")
        raise NoTokenizer(f"the run's data (data={name}) has none: pydoc and text_file are byte-level (ids are "
                          f"UTF-8 bytes); data=token_bin from python -m pipedream.data.prepare records its tokenizer")
    data_path = Path(str(data_cfg.get("path"))).expanduser()
    if not data_path.exists():   # a relative path is the run's: from another folder it is not found
        raise NoTokenizer(f"data.path={data_path} does not exist here: export from the folder the run started in")
    path = meta_path(data_path)
    if not path.is_file():
        raise NoTokenizer(f"{path} does not exist: python -m pipedream.data.prepare writes one naming the tokenizer")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise NoTokenizer(f"{path}, which would name the tokenizer, is not readable JSON ({error})") from None
    return (meta if isinstance(meta, dict) else {}), path


def token_content(token: Any) -> str | None:
    """A tokenizer_config.json token entry: a string, or an AddedToken dict with its ``content``."""
    token = token.get("content") if isinstance(token, dict) else token
    return token if isinstance(token, str) else None


def source_tokenizer_config(folder: Path) -> dict[str, Any]:
    """The tokenizer_config.json beside the tokenizer.json (a saved Hugging Face tokenizer), or {}."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def load_tokenizer_file(file: Path, meta_file: Path) -> Any:
    try:
        from tokenizers import Tokenizer
        return Tokenizer.from_file(str(file))
    except ImportError:
        raise NoTokenizer("copying the tokenizer needs the tokenizers package: pip install .[hf]") from None
    except Exception as error:   # the Rust side raises plain Exceptions for a missing or malformed file
        raise NoTokenizer(f"{file}, the tokenizer {meta_file} names, does not load "
                          f"({str(error).splitlines()[0] if str(error) else type(error).__name__})") from None


def run_tokenizer(data_cfg: dict[str, Any]) -> RunTokenizer:
    """The run's tokenizer, as its data's meta.json names it; NoTokenizer says why there is none."""
    meta, meta_file = data_meta(data_cfg)
    source = str(meta.get("tokenizer") or "")
    if not source or source.startswith("tiktoken:"):
        raise NoTokenizer(f"{meta_file} names tokenizer {source or 'none'}, not a tokenizer.json that "
                          f"transformers loads from a folder")
    tokenizer = load_tokenizer_file(Path(source), meta_file)
    eos_id = meta.get("eos_id")
    eos = None if eos_id is None else tokenizer.id_to_token(int(eos_id))
    config = source_tokenizer_config(Path(source).parent)
    bos = token_content(config.get("bos_token"))
    if bos is None or tokenizer.token_to_id(bos) is None:
        bos = eos   # the data's documents each start after an EOS (none has a BOS): generation starts from one
    # PreTrainedTokenizerFast runs tokenizer.json as it is, as prepare encoded the data with it
    config |= {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos}
    return RunTokenizer(Path(source), config, None if bos is None else tokenizer.token_to_id(bos), eos_id)


def write_tokenizer(tokenizer: RunTokenizer, out: Path) -> list[Path]:
    """tokenizer.json and tokenizer_config.json in ``out``."""
    shutil.copyfile(tokenizer.file, out / "tokenizer.json")   # contents only: the umask sets the mode
    config = out / "tokenizer_config.json"
    config.write_text(json.dumps(tokenizer.config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return [out / "tokenizer.json", config]
