"""A run directory belongs to one run: a new run refuses a directory that already holds another
run's outputs unless it continues that run (``train.resume``) or replaces it (``train.overwrite``)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from pipedream.errors import ConfigError
from pipedream.config.specs import default_checkpoint_root

if TYPE_CHECKING:
    from pipedream.config.run_spec import RunSpec

RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "config.yaml", "checkpoints", "trace", "tensorboard")


def existing_outputs(run_dir: Path, checkpoints: Path) -> list[Path]:
    """Another run's outputs in ``run_dir`` and its checkpoint folders in ``checkpoints``."""
    found = [run_dir / name for name in RUN_OUTPUTS
             if (run_dir / name).is_file() or ((run_dir / name).is_dir() and any((run_dir / name).iterdir()))]
    if checkpoints.is_dir() and checkpoints != default_checkpoint_root(run_dir):
        found += sorted(p for p in checkpoints.iterdir() if p.name.startswith("step_"))
    return found


def claim_run_dir(spec: RunSpec, run_dir: Path) -> None:
    """Raises ConfigError if ``run_dir`` holds another run and neither resume nor overwrite is set;
    with ``train.overwrite=true`` removes the old outputs first."""
    resume, overwrite = spec.checkpoint.resume, spec.loop.overwrite
    if resume and overwrite:
        raise ConfigError(f"train.resume={resume} and train.overwrite=true contradict each other: "
                          f"drop one (resume continues the run in {run_dir}, overwrite replaces it)")
    if resume:
        return
    checkpoints = spec.checkpoint.root(run_dir)
    found = existing_outputs(run_dir, checkpoints)
    if not found:
        return
    if not overwrite:
        names = ", ".join(str(p.relative_to(run_dir)) if p.is_relative_to(run_dir) else str(p) for p in found[:4])
        more = f" and {len(found) - 4} more" if len(found) > 4 else ""
        raise ConfigError(f"train.run_dir={run_dir} already holds another run's outputs ({names}{more}): "
                          f"continue it with train.resume=auto, replace it with train.overwrite=true, "
                          f"or choose another train.run_dir")
    for path in found:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def output_path_problem(value: str, is_file: bool = False) -> str | None:
    """Why ``value`` cannot become an output folder (or, with ``is_file``, a file in an existing
    folder), or None: checked before any work, so a typo fails at once rather than at the end."""
    path = Path(value).expanduser().absolute()
    if path.exists() and path.is_dir() == is_file:
        return "is a folder, not a file" if is_file else "is a file, not a folder"
    folder = path.parent if is_file else path
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"sits under {existing}, which is a file"
    if is_file and existing != folder:
        return f"cannot be written: its folder {folder} does not exist"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot be written ({existing} is not writable)"
    return None
