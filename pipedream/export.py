"""``python -m pipedream.export run_dir=runs/<run> [out=model.pt] [step=N]``: consolidates the latest
complete sharded checkpoint of a run into one state dict that the plain single-process model
(``models.build_model(cfg.model).build_sequential()``) loads; also writes ``.safetensors`` when the
safetensors package is installed."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from .checkpoint import complete_checkpoints, step_dir
from .specs import default_checkpoint_root


def consolidate(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Global names ``layers.<i>.<param>`` become the single-process model's ``<i>.<param>``."""
    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "merged.pt"
        dcp_to_torch_save(str(checkpoint), str(merged))
        state = torch.load(merged, weights_only=False)
    model = state["model"]
    return {key.removeprefix("layers."): value for key, value in sorted(model.items())}


def export(run_dir: Path, out: Path | None = None, step: int | None = None) -> list[Path]:
    root = default_checkpoint_root(run_dir)
    if step is not None:
        checkpoint = step_dir(root, step)
        if checkpoint not in complete_checkpoints(root):
            raise FileNotFoundError(f"no complete checkpoint for step {step} in {root}")
    else:
        found = complete_checkpoints(root)
        if not found:
            raise FileNotFoundError(f"no complete checkpoint in {root}: train with checkpoint.every=N first")
        checkpoint = found[-1]
    state = consolidate(checkpoint)
    out = out or run_dir / "model.pt"
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
    try:
        written = export(Path(args["run_dir"]), Path(args["out"]) if "out" in args else None,
                         int(args["step"]) if "step" in args else None)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
