"""``python -m pipedream.export run_dir=runs/<run> [out=model.pt] [step=N]``: consolidates the latest
complete sharded checkpoint of a run into one state dict that the plain single-process model
(``models.build_model(cfg.model).build_sequential()``) loads; also writes ``.safetensors`` when the
safetensors package is installed."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from pipedream.checkpoint.integrity import checkpoint_problem
from pipedream.checkpoint.plain import NotPlainFileError, load_plain
from pipedream.multi_model.export import is_fused_state, model_paths, split_models
from pipedream.config.specs import default_checkpoint_root


class ExportError(ValueError):
    """Nothing to export where asked: the message names the folder and why."""


def checkpoint_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith("step_")) if root.is_dir() else []


def choose_checkpoint(root: Path, step: int | None) -> Path:
    """The step's checkpoint, or the newest intact one (size and checksum of every file), warning about
    newer ones passed over; torch-free, so a bad request fails at once."""
    if step is not None:
        checkpoint = root / f"step_{step:08d}"
        problem = checkpoint_problem(checkpoint)
        if problem:
            raise ExportError(f"step={step}: {checkpoint} is not a usable checkpoint ({problem}): choose another step "
                              f"(present: {', '.join(p.name for p in checkpoint_folders(root)) or 'none'})")
        return checkpoint
    for checkpoint in reversed(checkpoint_folders(root)):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint
        print(f"warning: checkpoint {checkpoint} is unusable ({problem}): skipped", file=sys.stderr)
    raise ExportError(f"no complete, intact checkpoint in {root}: train with checkpoint.every=N first")


def consolidate(checkpoint: Path) -> dict[str, Any]:
    """Global names ``layers.<i>.<param>`` become the single-process model's ``<i>.<param>``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "merged.pt"
        dcp_to_torch_save(str(checkpoint), str(merged))
        state = load_plain(merged)
    model = state["model"]
    return {key.removeprefix("layers."): value for key, value in sorted(model.items())}


def export(run_dir: Path, out: Path | None = None, step: int | None = None) -> list[Path]:
    checkpoint = choose_checkpoint(default_checkpoint_root(run_dir), step)
    import torch   # after the choice: a bad request fails at once
    state = consolidate(checkpoint)
    out = out or run_dir / "model.pt"
    if is_fused_state(state):   # a fused set (train.models): one file per model, model_<k>.pt
        models = split_models(state)
        return [path for model, path in zip(models, model_paths(out, len(models))) for path in _save(model, path)]
    return _save(state, out)


def _save(state: dict[str, Any], out: Path) -> list[Path]:
    import torch
    torch.save(state, out)
    written = [out]
    try:
        from safetensors.torch import save_file
    except ImportError:
        return written
    # safetensors refuses tensors that share memory (a tied head): store independent copies
    save_file({k: v.contiguous().clone() for k, v in state.items()}, str(out.with_suffix(".safetensors")))
    return written + [out.with_suffix(".safetensors")]


def main(argv: list[str]) -> int:
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    unknown = [a for a in argv if "=" not in a] + [k for k in args if k not in ("run_dir", "out", "step")]
    if unknown or "run_dir" not in args:
        print("usage: python -m pipedream.export run_dir=RUN_DIR [out=FILE] [step=N]", file=sys.stderr)
        return 2
    step = args.get("step")
    if step is not None and not step.isdigit():
        print(f"error: step={step} is not a step number: give the N of a step_0000000N folder, or leave step out "
              f"for the newest", file=sys.stderr)
        return 2
    try:
        written = export(Path(args["run_dir"]), Path(args["out"]) if "out" in args else None,
                         None if step is None else int(step))
    except (ExportError, NotPlainFileError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
