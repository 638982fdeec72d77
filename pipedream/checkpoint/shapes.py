"""Does a checkpoint hold this model? Compares the parameter shapes recorded in DCP's ``.metadata``
with the model built on the meta device (no memory, no weights), before anything is loaded, so a
checkpoint of another model or shape is named as such instead of failing inside DCP."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Parameter name (``layers.<i>.<name>``) -> shape, from the checkpoint's metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    return {key.removeprefix("model."): tuple(entry.size) for key, entry in metadata.state_dict_metadata.items()
            if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)}


def model_shapes(model_cfg: Any) -> dict[str, tuple[int, ...]]:
    import torch

    from models import build_model

    with torch.device("meta"):
        layers = build_model(model_cfg).build()
    return {f"layers.{index}.{name}": tuple(param.shape) for index, layer in sorted(layers.items())
            for name, param in layer.named_parameters(remove_duplicate=False)}


def shape_mismatch(path: Path, model_cfg: Any) -> str | None:
    """The first parameter this model and the checkpoint disagree on, with both shapes, or None."""
    saved, wanted = saved_shapes(path), model_shapes(model_cfg)
    for name, shape in wanted.items():
        if name not in saved:
            return f"it has no parameter {name} (this model's {list(shape)})"
        if saved[name] != shape:
            return f"parameter {name} has shape {list(saved[name])} there but {list(shape)} in this model"
    extra = sorted(set(saved) - set(wanted))
    if extra:
        return f"it holds parameter {extra[0]} {list(saved[extra[0]])}, which this model lacks"
    return None
