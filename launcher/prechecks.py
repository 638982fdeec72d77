"""Checks the launcher makes before torchrun starts, beyond the run spec: the types of the keys it
reads itself, the device and optional packages, the output folders, the data files and the
checkpoint to resume from. Each failure is one ``ConfigError`` line naming the value, the rule and
a way out (docs/reliability.md lists them all)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from pipedream.errors import ConfigError
from pipedream.config.specs import Section

DEVICES = ("cpu", "cuda", "auto")


def check_launch_keys(cfg: Any) -> None:
    """Before any number is read: the parallel degrees and the ``launcher.*`` keys."""
    parallel = Section(cfg, "parallel")
    for key in ("pp", "dp", "tp", "vpp"):
        parallel.integer(key, 1)
    launcher = Section(cfg, "launcher")
    nnodes = launcher.integer("nnodes", 1)
    launcher.integer("max_restarts", 0, " (0: a failed job is not restarted)")
    port = launcher.integer("master_port", 1)
    if port > 65535:
        raise ConfigError(f"launcher.master_port = {port} is not a TCP port: choose one in 1024..65535")
    node_rank = launcher.raw("node_rank")
    if node_rank is not None and (not isinstance(node_rank, int) or isinstance(node_rank, bool)
                                  or not 0 <= node_rank < nnodes):
        raise ConfigError(f"launcher.node_rank = {node_rank!r} must be a node number in 0..{nnodes - 1} "
                          f"(launcher.nnodes = {nnodes}), or null to print every node's command")
    if launcher.number("grace_s") < 0:
        raise ConfigError(f"launcher.grace_s = {launcher.raw('grace_s')} must be >= 0 (seconds a stopped job gets "
                          f"before it is killed; 0 kills at once)")
    launcher.positive_number("rendezvous_timeout_s")
    launcher.positive_number("last_call_s")
    launcher.flag("dry_run")
    launcher.flag("check_memory")


def check_device_and_packages(cfg: Any, runs_here: bool) -> None:
    """The device name always; whether this machine has that device and the optional packages only
    when the job runs here (a dry run may print the commands of GPU nodes on a login node)."""
    device = Section(cfg, "cluster").raw("device")
    if device not in DEVICES:
        raise ConfigError(f"cluster.device={device!r} is not supported: choose one of {', '.join(DEVICES)}")
    if not runs_here:
        return
    if device == "cuda":
        import torch  # only here: the other checks stay fast
        if not torch.cuda.is_available():
            raise ConfigError("cluster.device=cuda but this machine has no usable CUDA device "
                              "(torch.cuda.is_available() is false): use cluster.device=cpu or auto")
    if Section(cfg, "logging").flag("tensorboard") and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("logging.tensorboard=true needs the tensorboard package, which is not installed: "
                          "pip install tensorboard, or set logging.tensorboard=false")


def check_outputs(cfg: Any, run_dir: str) -> None:
    """The run folder and a separate checkpoint folder must be folders this user can create or write."""
    from pipedream.observe.run_outputs import output_path_problem
    for key, value in (("train.run_dir", run_dir), ("checkpoint.dir", Section(cfg, "checkpoint").optional_text("dir"))):
        problem = value and output_path_problem(value)
        if problem:
            raise ConfigError(f"{key}={value} {problem}: choose a folder path you can write to")


def check_resume(cfg: Any, spec: Any, run_dir: str) -> None:
    """An explicit ``train.resume`` folder: exists, is a step folder, complete and intact (sizes and
    checksums), and holds this model's parameters with these shapes; with ``auto``, the newest intact
    checkpoint holds them."""
    resume = spec.checkpoint.resume
    if not resume:
        return
    from pipedream.checkpoint.integrity import MARKER, checkpoint_problem
    if resume == "auto":   # the ranks fall back past damaged ones; another model's is refused here
        root = spec.checkpoint.root(Path(run_dir))
        intact = [p for p in sorted(root.glob("step_*")) if checkpoint_problem(p) is None] if root.is_dir() else []
        if intact:
            _check_shapes(cfg, intact[-1], f"train.resume=auto found {intact[-1]}, which")
        return
    path = Path(resume).expanduser()
    if not path.exists():
        raise ConfigError(f"train.resume={resume} does not exist: give a checkpoint's step_XXXXXXXX folder, or "
                          f"train.resume=auto to continue the newest one of train.run_dir")
    steps = sorted(p.name for p in [path, *path.glob("checkpoints")] if p.is_dir()
                   for p in p.glob("step_*") if (p / MARKER).exists())
    if steps and not (path / MARKER).exists():
        raise ConfigError(f"train.resume={resume} is a run or checkpoint folder, not one checkpoint: give one "
                          f"of its step folders (newest: {steps[-1]}), or train.resume=auto with "
                          f"train.run_dir set to the run")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ConfigError(f"train.resume={resume} is not a usable checkpoint ({problem}): use train.resume=auto "
                          f"or another step_XXXXXXXX folder")
    _check_shapes(cfg, path, f"train.resume={resume}")


def _check_shapes(cfg: Any, path: Path, named: str) -> None:
    from pipedream.checkpoint.shapes import shape_mismatch
    mismatch = shape_mismatch(path, cfg.model)
    if mismatch:
        raise ConfigError(f"{named} was saved by another model: {mismatch}: resume with the model settings it "
                          f"was trained with (its config.yaml), or start a new run")


def check_rendezvous_port(cfg: Any) -> None:
    """Node 0 of a multi-node job hosts the rendezvous on ``launcher.master_port``: a port already taken
    would make torchrun fail after its own timeouts."""
    import socket

    port = int(cfg.launcher.master_port)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("", port))
        except OSError as error:
            raise ConfigError(f"launcher.master_port={port} is taken on this machine (node 0 hosts the "
                              f"rendezvous there: {error.strerror}): choose a free port, or stop what holds it") from None


def check_before_launch(cfg: Any, spec: Any, run_dir: str, launching: bool, hosts_rendezvous: bool) -> list[str]:
    """Every check above that applies; returns warnings (one line each)."""
    from pipedream.data.checks import check_data

    check_device_and_packages(cfg, launching)
    check_outputs(cfg, run_dir)
    check_resume(cfg, spec, run_dir)
    if hosts_rendezvous:
        check_rendezvous_port(cfg)
    return [f"warning: {note}" for note in check_data(cfg.data, cfg.model, spec.seq_len)]
