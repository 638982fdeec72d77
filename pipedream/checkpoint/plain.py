"""Reading the small torch files a checkpoint keeps beside DCP's shards (each rank's RNG state, the
consolidated state dict of an export) as data, never as code: ``torch.load(weights_only=True)``
accepts tensors, dicts, lists, tuples, numbers, strings and None, and refuses any other pickled
object (a class, a function, ``os.system``) before anything runs."""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

_PREAMBLE = "Weights only load failed"


class NotPlainFileError(ValueError):
    """A checkpoint file that holds more than tensors and plain values: refused unexecuted."""


def refusal_reason(error: BaseException) -> str:
    """The one line of torch's weights-only refusal that says what was found (its other paragraphs
    are general advice, including to load with weights_only=False, which is what must not happen)."""
    paragraphs = [" ".join(p.split()) for p in str(error).split("\n\n") if p.strip()]
    specific = [p for p in paragraphs if not p.startswith(_PREAMBLE) and not p.startswith("Check the documentation")]
    return (specific or paragraphs or [type(error).__name__])[0][:200]


def load_plain(path: Path) -> Any:
    """``path``'s contents, or NotPlainFileError (one line naming the file) when it is not plain data."""
    import torch
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as error:
        raise NotPlainFileError(f"{path} is not a plain checkpoint file (tensors, numbers, strings, lists and "
                                f"dicts only): refused without running it ({refusal_reason(error)}); load only "
                                f"checkpoints you wrote yourself or trust") from None
