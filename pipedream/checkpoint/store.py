"""Sharded, atomic checkpoints through torch.distributed.checkpoint (DCP).

Every rank saves its own layers under their *global* names (``layers.<index>.<param>``), so a
checkpoint written by one layout (pp, dp, layer split) loads into another: DCP matches names and
each rank reads only what it now owns. Optimizer state is flattened to the same names
(``flatten_optimizer_state_dict``) for the same reason. Data-parallel replicas hold the same
tensors; DCP's planner writes each once.

Atomicity: a checkpoint is written into ``step_XXXXXXXX.partial/``; after every rank has finished
(a barrier), rank 0 renames it to ``step_XXXXXXXX/`` and writes ``COMMITTED`` last, with every
file's size and CRC-32. A folder without the marker, or whose files differ from it (truncated, bit
flips, zero-filled) or cannot be read, is skipped at load, with a warning, in favour of the previous
complete one. Pruning removes the marker first, so a checkpoint half deleted by a kill is incomplete
and goes at the next prune. A write that fails (a full disk) fails the save on every rank at once:
the half-written folder is removed and one CheckpointError names it, the cause and the newest
complete checkpoint.
"""
from __future__ import annotations

import io
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from pipedream.checkpoint.plain import load_plain
from pipedream.checkpoint.integrity import MARKER, checkpoint_problem, completeness_problem, has_checksums, manifest
from pipedream.errors import stderr_line
from pipedream.numerics.sharded_optim import ShardedOptimizer
from pipedream.config.specs import CheckpointSpec
from pipedream.runtime.engine_protocol import Engine

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was asked for, or one that cannot serve this layout."""


def layers_module(layers: dict[int, nn.Module]) -> nn.Module:
    """Wraps a rank's layers so their parameter names are global: ``layers.<index>.<name>``."""
    wrapper = nn.Module()
    wrapper.layers = nn.ModuleDict({str(i): layer for i, layer in sorted(layers.items())})
    return wrapper


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoints, oldest first; incomplete folders are reported and ignored."""
    if not root.exists():
        return []
    found = []
    for path in sorted(root.iterdir()):
        if not path.name.startswith("step_"):
            continue
        problem = completeness_problem(path)
        if problem is None:
            found.append(path)
        else:
            warnings.warn(f"checkpoint {path} is unusable ({problem}): skipped", stacklevel=2)
    return found


def _warn(rank: int, message: str) -> None:
    if rank == 0:
        stderr_line(f"warning: {message}")


def _agreed(rank: int, decide: Any) -> Any:
    """Rank 0 runs ``decide()`` and every rank gets its answer (one reader of the files)."""
    holder = [decide() if rank == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _first_error(error: BaseException | None) -> list[str | None]:
    """Every rank's error (one line each, None where none), so all ranks act together."""
    line = None
    if error is not None:  # DCP's CheckpointException carries each rank's traceback: its last line says what
        line = (str(error).strip().splitlines() or [type(error).__name__])[-1].strip()[:300]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, line)
        return errors
    return [line]


def load_verified(candidates: list[Path], module: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                  layout_key: str, rank: int, tp: Any = None) -> tuple[Path, int]:
    """Collective. Loads the newest of ``candidates`` (oldest first) whose files match their marker and
    that loads without error; each one passed over gets one warning line. Raises CheckpointError when
    none is left."""
    for index in range(len(candidates) - 1, -1, -1):
        path = candidates[index]
        fallback = f"falling back to {candidates[index - 1].name}" if index else "no older checkpoint left"
        problem = _agreed(rank, lambda: checkpoint_problem(path))
        if problem is None:
            try:
                step, error = load_checkpoint(path, module, optimizer, scheduler, layout_key, rank, tp), None
            except (Exception, CheckpointException) as failure:  # unreadable .metadata or shard: DCP raises
                step, error = -1, failure
            problem = next((f"loading failed: {line}" for line in _first_error(error) if line), None)
        if problem is None:
            if not _agreed(rank, lambda: has_checksums(json.loads((path / MARKER).read_text()))):
                _warn(rank, f"checkpoint {path} has no content checksums (older format): checked by size only")
            return path, step
        _warn(rank, f"checkpoint {path} is unusable ({problem}): {fallback}")
    root = candidates[0].parent if candidates else "the checkpoint folder"
    raise CheckpointError(f"no usable checkpoint in {root}: every complete one failed its check (see the warnings); "
                          f"start afresh with train.overwrite=true or point train.resume at a good folder")


def checkpoint_step(path: Path) -> int:
    return int(json.loads((path / MARKER).read_text())["step"])


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


def _sharded_fqns(module: nn.Module) -> dict[str, Any]:
    """Global parameter name -> ShardSpec, for tensor-parallel shards."""
    from models.tensor_parallel import shard_spec
    return {name: shard_spec(p) for name, p in module.named_parameters(remove_duplicate=False)
            if shard_spec(p) is not None}


def _shard_keys(state: dict[str, Any], specs: dict[str, Any]) -> dict[str, Any]:
    """State-dict key -> ShardSpec for every entry shaped like a sharded parameter: the parameter
    itself (``model``) and its optimizer moments (``optim``: ``state.<name>.<moment>``)."""
    keys = {}
    for name, spec in specs.items():
        keys[f"model.{name}"] = spec
        prefix = f"optim.state.{name}."
        for key, value in state["optim"].items():
            if ("optim." + key).startswith(prefix) and torch.is_tensor(value) and value.dim() > 0:
                keys["optim." + key] = spec
    return keys


def _get(state: dict[str, Any], key: str) -> Any:
    part, _, rest = key.partition(".")
    return state[part][rest]


def _set(state: dict[str, Any], key: str, value: Any) -> None:
    part, _, rest = key.partition(".")
    state[part][rest] = value


def _dense_state(state: dict[str, Any], module: nn.Module, tp: Any) -> dict[str, Any]:
    """Tensor-parallel shards become dense tensors under the dense names (every tp rank holds the
    same, DCP writes it once), so a checkpoint loads into any tensor-parallel degree."""
    from models.tensor_parallel import gather_tensor
    for key, spec in _shard_keys(state, _sharded_fqns(module)).items():
        _set(state, key, gather_tensor(_get(state, key), spec, tp))
    return state


def save_checkpoint(root: Path, step: int, module: nn.Module, optimizer: torch.optim.Optimizer,
                    layout_key: str, extra: dict[str, Any], rank: int, keep: int, tp: Any = None) -> Path:
    """Collective: every rank calls it. Returns the committed folder. A write that fails on any rank
    (a full disk, a file-size limit) raises CheckpointError on every rank, after the folder is removed:
    the checkpoints committed before stay as they were."""
    final = step_dir(root, step)
    partial = final.with_name(final.name + ".partial")

    def start() -> None:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True, exist_ok=True)

    def write_shards() -> None:
        _whole_parameters(optimizer)
        state = {"model": get_model_state_dict(module, options=OPTIONS),
                 "optim": get_optimizer_state_dict(module, optimizer, options=OPTIONS)}
        if tp is not None and tp.size > 1:
            state = _dense_state(state, module, tp)
        state["optim"] = _with_tied_aliases(state["optim"], module)
        dcp.save(state, checkpoint_id=str(partial))
        # RNG streams are per rank and only meaningful for the same layout: kept beside DCP's files.
        # Serialised in memory first: a failed write is then Python's OSError, not torch's opaque one
        buffer = io.BytesIO()
        torch.save({"layout": layout_key, "rng": rng_state()}, buffer)
        (partial / f"rank{rank}.pt").write_bytes(buffer.getvalue())

    def commit() -> None:
        if rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
            (final / "extra.json").write_text(json.dumps(extra, indent=1, default=str))
            (final / MARKER).write_text(json.dumps({"step": step, **manifest(final, MARKER)}))  # last: now it counts

    # each phase ends when every rank knows every rank's outcome (a barrier); a failed one leaves nothing
    for phase, written in ((start, (partial,)), (write_shards, (partial,)), (commit, (partial, final))):
        _written_everywhere(phase, root, written, rank)
    if rank == 0:
        prune(root, final, keep)
    dist.barrier()
    return final


def _written_everywhere(phase: Any, root: Path, folders: tuple[Path, ...], rank: int) -> None:
    """Collective. Runs ``phase``; if its writes failed on any rank, rank 0 removes the half-written
    ``folders`` and every rank raises one CheckpointError naming the folder and the cause."""
    failure = None
    try:
        phase()
    except (OSError, CheckpointException) as error:   # ENOSPC, EFBIG; DCP gathers its ranks' into one
        failure = error
    lines = _first_error(failure)
    failed = next(((index, line) for index, line in enumerate(lines) if line), None)
    if failed is None:
        return
    if rank == 0:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    newest = [path for path in sorted(root.iterdir()) if path.name.startswith("step_")
              and completeness_problem(path) is None] if root.is_dir() else []
    kept = f"{newest[-1]} is the newest complete checkpoint" if newest else "no complete checkpoint was written before"
    target = root / folders[0].name.removesuffix(".partial")
    raise CheckpointError(f"checkpoint {target} could not be written (rank {failed[0]}: {failed[1]}): free space "
                          f"on that disk, or set checkpoint.dir to one with room; {kept} (train.resume=auto "
                          f"continues from it)")


def _with_tied_aliases(optim_state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """A parameter registered under several names (an embedding tied to the head, both on this rank)
    has its optimizer state saved under its first name only; a layout that puts the two on different
    ranks loads each name on its own, so every name gets the state. The copies on two ranks are equal
    (their gradients are summed before each step), so one saved state serves both."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    aliases = [(group[0], other) for group in names.values() for other in group[1:]]
    extra = {}
    for key, value in optim_state.items():
        for first, other in aliases:
            for section in ("state", "param_groups"):
                prefix = f"{section}.{first}."
                if key.startswith(prefix):
                    extra[f"{section}.{other}.{key.removeprefix(prefix)}"] = value
    return {**optim_state, **extra}


def prune(root: Path, newest: Path, keep: int) -> None:
    """Keeps the ``keep`` newest complete checkpoints; also removes leftovers older than ``newest``
    (a save or a prune cut short by a kill). The marker goes first: a half-deleted folder never counts."""
    if keep <= 0:
        return
    kept = complete_checkpoints(root)[-keep:]
    for path in sorted(root.iterdir()):
        if path.is_dir() and path.name.startswith("step_") and path.name < newest.name and path not in kept:
            (path / MARKER).unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)


def _whole_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Collective: checkpoints hold whole parameters, whatever the ZeRO level (a zero3 rank gathers
    them; they stay whole until its next step's SYNC frees them), so they load into any dp degree
    and level."""
    if isinstance(optimizer, ShardedOptimizer):
        optimizer.whole_parameters()


def load_checkpoint(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    layout_key: str, rank: int, tp: Any = None) -> int:
    """Collective. Loads weights and optimizer state (into any layout), the schedule position and,
    for the same layout, this rank's RNG state. Returns the number of steps already done. This rank's
    RNG file is read first, as data only (``load_plain``): one holding pickled objects is refused before
    anything of the checkpoint is loaded."""
    own = path / f"rank{rank}.pt"
    saved = load_plain(own) if own.exists() else None
    _whole_parameters(optimizer)
    state = {"model": get_model_state_dict(module, options=OPTIONS),
             "optim": get_optimizer_state_dict(module, optimizer, options=OPTIONS)}
    shards = {}
    if tp is not None and tp.size > 1:  # read dense tensors, keep this rank's slice
        shards = _shard_keys(state, _sharded_fqns(module))
        for key, spec in shards.items():
            shard = _get(state, key)
            shape = list(shard.shape)
            shape[spec.dim] = spec.full_size
            _set(state, key, torch.empty(shape, dtype=shard.dtype, device=shard.device))
    dcp.load(state, checkpoint_id=str(path))
    if shards:
        from models.tensor_parallel import shard_tensor
        for key, spec in shards.items():
            _set(state, key, shard_tensor(_get(state, key), spec, tp))
    set_model_state_dict(module, state["model"], options=OPTIONS)
    if isinstance(optimizer, ShardedOptimizer):   # zero3: its shard of the loaded parameters
        optimizer.parameters_loaded()
    set_optimizer_state_dict(module, optimizer, state["optim"], options=OPTIONS)
    step = checkpoint_step(path)
    set_schedule_position(optimizer, scheduler, step)
    if saved is not None and saved["layout"] == layout_key:
        torch.set_rng_state(saved["rng"]["torch"])
        if "cuda" in saved["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(saved["rng"]["cuda"])
    return step


class RunCheckpoints:
    """The trainer's view: resume at start (``train.resume``), save every ``checkpoint.every`` steps
    and, with ``checkpoint.at_end``, once more when the run has done its steps."""

    def __init__(self, spec: CheckpointSpec, record: dict[str, Any], engine: Engine, rank: int, run_dir: Path):
        """``record`` (the resolved config, the plan) is stored beside every checkpoint."""
        self.every, self.keep, self.at_end = spec.every, spec.keep, spec.at_end
        self.root = spec.root(run_dir)
        self.resume_from = spec.resume
        self.engine, self.rank = engine, rank
        spec = engine.spec
        cp = f"-cp{spec.layout.cp}" if spec.layout.cp > 1 else ""   # (the keys of cp = 1 runs predate cp)
        self.layout_key = (f"pp{spec.layout.pp}-dp{spec.layout.dp}-tp{spec.layout.tp}{cp}-v{spec.layout.vpp}-"
                           f"{spec.schedule.name}-{list(spec.bounds)}")
        self.module = layers_module(engine.global_layers())
        self.extra = {**record, "layout": self.layout_key}
        self.saved: tuple[int, Path] | None = None   # the latest (step, folder) this run wrote

    def resume(self) -> int:
        """Steps already done (0 for a fresh run)."""
        if not self.resume_from:
            return 0
        if str(self.resume_from) == "auto":
            found = complete_checkpoints(self.root)
            if not found:
                if self.rank == 0:
                    print(f"resume: no complete checkpoint in {self.root}; starting from step 0", flush=True)
                return 0
        else:
            path = Path(str(self.resume_from))
            problem = _agreed(self.rank, lambda: checkpoint_problem(path))
            if problem is not None:
                raise CheckpointError(f"train.resume={path} is not a usable checkpoint ({problem}): "
                                      f"use train.resume=auto or another step_XXXXXXXX folder")
            found = [path]
        path, step = load_verified(found, self.module, self.engine.optimizer, self.engine.scheduler,
                                   self.layout_key, self.rank, self.engine.tp)
        self.engine.resume_at(step)
        _restore_loss_scaler(self.engine, path)
        if self.rank == 0:
            print(f"resume: continuing after step {step} from {path}", flush=True)
        return step

    def after_step(self, steps_done: int) -> None:
        if self.every > 0 and steps_done % self.every == 0:
            self.save(steps_done)

    def finished(self, steps_done: int, resumed_at: int) -> None:
        """Collective, once the run has done its steps: the final checkpoint, unless this run did no
        step (resumed at its end: that checkpoint is already there)."""
        if self.at_end and steps_done > resumed_at:
            self.save(steps_done)

    def save(self, steps_done: int) -> Path:
        """Collective: the checkpoint after ``steps_done`` steps (written once, however often asked)."""
        if self.saved is not None and self.saved[0] == steps_done:
            return self.saved[1]
        self.engine.drain()  # asynchronous schedules: nothing in flight, weights well defined
        path = save_checkpoint(self.root, steps_done, self.module, self.engine.optimizer, self.layout_key,
                               {**self.extra, "step": steps_done, **_loss_scaler_state(self.engine)}, self.rank,
                               self.keep, self.engine.tp)
        if self.rank == 0:
            print(f"checkpoint: saved {path}", flush=True)
        self.saved = (steps_done, path)
        return path


def _loss_scaler_state(engine: Engine) -> dict[str, Any]:
    """fp16: the scale every rank agrees on, stored once in extra.json (it loads into any layout)."""
    scaler = engine.loss_scaler
    return {"loss_scaler": scaler.state_dict()} if scaler is not None else {}


def _restore_loss_scaler(engine: Engine, path: Path) -> None:
    scaler = engine.loss_scaler
    if scaler is None:
        return
    state = json.loads((path / "extra.json").read_text()).get("loss_scaler")
    if state is None:
        raise CheckpointError(f"{path} was saved without fp16 loss scaling (precision was not fp16): resume it with "
                              f"its own precision, or start a new run")
    scaler.load_state_dict(state)
