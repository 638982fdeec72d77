"""Sharded, atomic checkpoints through torch.distributed.checkpoint (DCP).

Every rank saves its own layers under their *global* names (``layers.<index>.<param>``), so a
checkpoint written by one layout (pp, dp, layer split) loads into another: DCP matches names and
each rank reads only what it now owns. Optimizer state is flattened to the same names
(``flatten_optimizer_state_dict``) for the same reason. Data-parallel replicas hold the same
tensors; DCP's planner writes each once.

Atomicity: a checkpoint is written into ``step_XXXXXXXX.partial/``; after every rank has finished
(a barrier), rank 0 renames it to ``step_XXXXXXXX/`` and writes ``COMMITTED`` last. A folder
without the marker is skipped at load, with a warning, in favour of the previous complete one.
"""
from __future__ import annotations

import json
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

MARKER = "COMMITTED"
STEP_DIR = re.compile(r"^step_(\d{8})$")
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was asked for, or one that cannot serve this layout."""


def layers_module(layers: dict[int, nn.Module]) -> nn.Module:
    """Wraps a rank's layers so their parameter names are global: ``layers.<index>.<name>``."""
    wrapper = nn.Module()
    wrapper.layers = nn.ModuleDict({str(i): layer for i, layer in sorted(layers.items())})
    return wrapper


@dataclass(frozen=True)
class TrainingState:
    """What besides weights and optimizer state a resumed run needs to continue exactly."""

    step: int                  # optimizer steps completed; the data order is a function of it
    scheduler: dict[str, Any]
    rng: dict[str, Any]


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoints, oldest first; incomplete folders are reported and ignored."""
    if not root.exists():
        return []
    found = []
    for path in sorted(root.iterdir()):
        if STEP_DIR.match(path.name) and (path / MARKER).exists() and (path / ".metadata").exists():
            found.append(path)
        elif path.name.startswith("step_"):
            warnings.warn(f"checkpoint {path} is incomplete (no {MARKER} marker or no DCP metadata): skipped",
                          stacklevel=2)
    return found


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_schedule_position(optimizer: torch.optim.Optimizer, scheduler: Any, step: int) -> None:
    """The learning rate is a function of the step: put the scheduler where ``step`` steps leave it."""
    scheduler.last_epoch = step
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def save_checkpoint(root: Path, step: int, module: nn.Module, optimizer: torch.optim.Optimizer,
                    layout_key: str, extra: dict[str, Any], rank: int, keep: int) -> Path:
    """Collective: every rank calls it. Returns the committed folder."""
    final = step_dir(root, step)
    partial = final.with_name(final.name + ".partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {"model": get_model_state_dict(module, options=OPTIONS),
             "optim": get_optimizer_state_dict(module, optimizer, options=OPTIONS)}
    dcp.save(state, checkpoint_id=str(partial))
    # RNG streams are per rank and only meaningful for the same layout: kept beside DCP's files
    torch.save({"layout": layout_key, "rng": rng_state()}, partial / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        (final / "extra.json").write_text(json.dumps(extra, indent=1, default=str))
        (final / MARKER).write_text(f"{step}\n")  # written last: the checkpoint now counts
        for old in complete_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    layout_key: str, rank: int) -> int:
    """Collective. Loads weights and optimizer state (into any layout), the schedule position and,
    for the same layout, this rank's RNG state. Returns the number of steps already done."""
    state = {"model": get_model_state_dict(module, options=OPTIONS),
             "optim": get_optimizer_state_dict(module, optimizer, options=OPTIONS)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(module, state["model"], options=OPTIONS)
    set_optimizer_state_dict(module, optimizer, state["optim"], options=OPTIONS)
    step = int((path / MARKER).read_text().strip())
    set_schedule_position(optimizer, scheduler, step)
    own = path / f"rank{rank}.pt"
    if own.exists():
        saved = torch.load(own, weights_only=False)
        if saved["layout"] == layout_key:
            torch.set_rng_state(saved["rng"]["torch"])
            if "cuda" in saved["rng"] and torch.cuda.is_available():
                torch.cuda.set_rng_state(saved["rng"]["cuda"])
    return step
