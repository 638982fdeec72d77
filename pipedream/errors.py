"""Errors that the entry points turn into one clear line and a non-zero exit."""
import sys
from typing import Sequence

from models.errors import ConfigError, DataError

__all__ = ["ConfigError", "DataError", "FINAL_EXIT", "InvariantError", "REFUSED_EXIT", "stderr_line",
           "unknown_key_problem"]


class InvariantError(RuntimeError):
    """A rule of the runtime itself was broken (a schedule, a version plan and the executor
    disagree): a defect in this project, not in the user's input."""


REFUSED_EXIT = 2   # a configuration refused before any process group exists
FINAL_EXIT = 3     # a deterministic failure after start (data, NaN, checkpoint): restarting cannot help


def stderr_line(text: str) -> None:
    """Writes `text` and its newline to stderr in one system call: `print` makes two, and the lines
    of ranks sharing the launcher's stderr then run together ("...malformederror: ...")."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def unknown_key_problem(key: str, known: Sequence[str], command: str) -> str:
    """``unknown key 'tokenzier' (python -m ... takes ...): did you mean 'tokenizer'?`` for the plain
    ``key=value`` commands (``pipedream.data.prepare``, ``pipedream.export``): difflib's closest key,
    the rule the launcher's ``suggest_key`` applies within a Hydra config group."""
    import difflib

    suggestion = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {suggestion[0]!r}?" if suggestion else "check its spelling"
    return f"unknown key {key!r} (python -m {command} takes {', '.join(known)}): {hint}"
