"""Typed, validated sections of the run configuration, read once by ``run_spec.build_run_spec``.

The runtime (engine, trainer, optimizer builder, checkpoints, trace) takes these frozen objects,
never a Hydra config. Defaults live in ``conf/config.yaml`` and ``conf/optim/*.yaml`` only: the
classes below state none, and a key the YAML should have provided is a ``ConfigError``. Field
names are the YAML keys, so ``train.lr`` is ``TrainSpec.lr``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipedream.errors import ConfigError

_ABSENT = object()


class Section:
    """Reads the keys of one config section, each failure one ``ConfigError`` naming the key."""

    def __init__(self, cfg: Any, name: str):
        self.name = name
        self.node = cfg.get(name, _ABSENT) if hasattr(cfg, "get") else _ABSENT
        if self.node is _ABSENT or not hasattr(self.node, "get"):
            raise ConfigError(f"config section {name} is missing: conf/config.yaml defines it")

    def raw(self, key: str) -> Any:
        value = self.node.get(key, _ABSENT)
        if value is _ABSENT:
            raise ConfigError(f"{self.name}.{key} is missing: conf/config.yaml (or the chosen {self.name} file) "
                              f"defines it")
        return value

    def integer(self, key: str, minimum: int, rule: str = "") -> int:
        value = self.raw(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigError(f"{self.name}.{key} = {value!r} must be an integer >= {minimum}{rule or f' (e.g. {self.name}.{key}={max(minimum, 1)})'}")
        return value

    def number(self, key: str) -> float:
        value = self.raw(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{self.name}.{key} = {value!r} must be a finite number: give one such as "
                              f"the default in conf/")
        return float(value)

    def positive_number(self, key: str) -> float:
        value = self.number(key)
        if not value > 0:
            raise ConfigError(f"{self.name}.{key} = {value:g} must be > 0: give a positive number such as "
                              f"the default in conf/")
        return value

    def flag(self, key: str) -> bool:
        value = self.raw(key)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.name}.{key} = {value!r} must be true or false")
        return value

    def optional_text(self, key: str) -> str | None:
        value = self.raw(key)
        return None if value is None else str(value)


def config_value(cfg: Any, dotted: str) -> Any:
    """``cfg``'s value at ``a.b.c``, None where any part is absent."""
    node = cfg
    for part in dotted.split("."):
        node = node.get(part) if hasattr(node, "get") else None
    return node


@dataclass(frozen=True)
class TrainSpec:
    """What the engine needs from ``train:``: the step count, the learning-rate schedule and the
    runtime options of the executor."""

    steps: int
    lr: float
    min_lr_ratio: float            # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int
    grad_clip: float               # 0: no clipping
    seed: int
    threads: int
    timeout_s: float
    fuse_grad_accumulation: bool
    weight_grads_after_send: bool
    weight_grads_delay: int
    overlap_grad_reduce: bool      # data-parallel buckets reduced during the backward (numerics/grad_buckets.py)
    grad_bucket_mb: float          # size of one such bucket, in MiB
    debug: bool                    # full tracebacks for unexpected errors (as PIPEDREAM_DEBUG=1)
    compile: str | None = None     # train.compile: the torch.compile backend each layer runs under; None: eager
    split_weight_graphs: bool = True   # zero-bubble B/W split of stock layers' graphs (runtime/weight_split.py)

    @classmethod
    def from_config(cls, cfg: Any) -> TrainSpec:
        train = Section(cfg, "train")
        lr = train.positive_number("lr")
        grad_clip = 0.0 if train.raw("grad_clip") is None else train.number("grad_clip")
        return cls(steps=train.integer("steps", 1), lr=lr, min_lr_ratio=train.number("min_lr_ratio"),
                   warmup_steps=train.integer("warmup_steps", 0), grad_clip=grad_clip,
                   seed=train.integer("seed", 0), threads=max(1, train.integer("threads", 0)),
                   timeout_s=train.positive_number("timeout_s"),
                   fuse_grad_accumulation=train.flag("fuse_grad_accumulation"),
                   weight_grads_after_send=train.flag("weight_grads_after_send"),
                   weight_grads_delay=train.integer("weight_grads_delay", 0, " (0 runs a backward's weight-gradient "
                                                    "GEMMs right after its send)"),
                   overlap_grad_reduce=train.flag("overlap_grad_reduce"),
                   grad_bucket_mb=train.positive_number("grad_bucket_mb"),
                   debug=train.flag("debug"), compile=_compile_backend(train.raw("compile")),
                   split_weight_graphs=train.flag("split_weight_graphs"))


def _compile_backend(value: Any) -> str | None:
    """train.compile: false (eager), true (inductor) or a torch.compile backend's name."""
    if value is None or value is False:
        return None
    if value is True:
        return "inductor"
    if isinstance(value, str) and value:
        import torch._dynamo   # the backends registered with this torch (debug ones included)
        if value in torch._dynamo.list_backends(exclude_tags=()):
            return value
        raise ConfigError(f"train.compile={value!r} is not a torch.compile backend: use true (inductor), false, "
                          f"or one of {', '.join(torch._dynamo.list_backends())}, aot_eager")
    raise ConfigError(f"train.compile = {value!r} must be true, false or a torch.compile backend's name")


@dataclass(frozen=True)
class LoopSpec:
    """What the training loop does around the steps: where it writes, logging and evaluation."""

    run_dir: str
    log_every: int
    eval_every: int                # 0: the validation loss only once, at the end
    eval_batches: int
    progress: bool
    tensorboard: bool              # logging.tensorboard
    overwrite: bool                # train.overwrite: replace another run's outputs in run_dir

    @classmethod
    def from_config(cls, cfg: Any) -> LoopSpec:
        train = Section(cfg, "train")
        return cls(run_dir=str(train.raw("run_dir")), log_every=max(1, train.integer("log_every", 0)),
                   eval_every=train.integer("eval_every", 0), eval_batches=train.integer("eval_batches", 1),
                   progress=train.flag("progress"), tensorboard=Section(cfg, "logging").flag("tensorboard"),
                   overwrite=train.flag("overwrite"))


@dataclass(frozen=True)
class RecomputeSpec:
    """``recompute:``, what the backward computes again instead of keeping: nothing, whole layers
    (``full``) or only their attention cores (``selective``, models/attention.py), in every layer
    of a stage chunk or only its first ``num_layers`` (None: all)."""

    granularity: str = "none"      # none | full | selective
    num_layers: int | None = None

    @property
    def full(self) -> bool:
        return self.granularity == "full"

    @property
    def selective(self) -> bool:
        return self.granularity == "selective"


@dataclass(frozen=True)
class OptimSpec:
    """``optim:``; the learning rate and its schedule are in ``TrainSpec``."""

    name: str                      # adamw | sgd
    weight_decay: float            # matrices only
    fused: bool                    # torch's fused kernel where the device has one
    impl: str                      # torch | apex (pipedream/numerics/apex.py)
    distributed: bool              # zero >= 1 (set from it; true alone means zero1)
    # None where the optimizer has no such option (betas/eps: adamw; momentum: sgd)
    betas: tuple[float, float] | None = None
    eps: float | None = None
    momentum: float | None = None
    zero: int = 0                  # ZeRO level 0..3 over the data-parallel group (numerics/sharded_optim.py)
    reshard_after_forward: bool = False   # zero3: gather and free around every action, not once per step

    def __post_init__(self) -> None:
        # ``distributed`` and ``zero`` say the same: specs built with either stay consistent
        zero = self.zero or (1 if self.distributed else 0)
        object.__setattr__(self, "zero", zero)
        object.__setattr__(self, "distributed", zero >= 1)

    @classmethod
    def from_config(cls, cfg: Any, choices: tuple[str, ...]) -> OptimSpec:
        optim = Section(cfg, "optim")
        name = optim.raw("name")
        if name not in choices:
            raise ConfigError(f"optim={name!r} is unknown: choose one of {', '.join(choices)}")
        impl = optim.raw("impl")
        if impl not in ("torch", "apex"):
            raise ConfigError(f"optim.impl={impl!r} is unknown: choose torch or apex")
        common = dict(name=name, weight_decay=optim.number("weight_decay"), fused=optim.flag("fused"), impl=impl,
                      distributed=False, zero=zero_level(optim.raw("distributed")),
                      reshard_after_forward=optim.flag("reshard_after_forward"))
        if name == "adamw":
            betas = optim.raw("betas")
            if isinstance(betas, (str, int, float)) or len(betas) != 2:
                raise ConfigError(f"optim.betas = {betas!r} must be two numbers, e.g. [0.9, 0.95]")
            return cls(**common, betas=(float(betas[0]), float(betas[1])), eps=optim.number("eps"))
        return cls(**common, momentum=optim.number("momentum"))


ZERO_LEVELS = {False: 0, True: 1, "false": 0, "true": 1, "zero1": 1, "zero2": 2, "zero3": 3}


def zero_level(value: Any) -> int:
    """``optim.distributed``: false | zero1 | zero2 | zero3 (true: zero1, as before the levels)."""
    level = ZERO_LEVELS.get(value.lower() if isinstance(value, str) else value) \
        if isinstance(value, (bool, str)) else None
    if level is None:
        raise ConfigError(f"optim.distributed = {value!r} is not a ZeRO level: it must be false, zero1, zero2 or "
                          f"zero3 (true means zero1); e.g. optim.distributed=zero2")
    return level


def default_checkpoint_root(run_dir: Path) -> Path:
    """``checkpoint.dir: null``: the run's own ``checkpoints`` folder."""
    return run_dir / "checkpoints"


@dataclass(frozen=True)
class CheckpointSpec:
    every: int                     # 0: never
    at_end: bool                   # one more after the last step (export and resume need one)
    dir: str | None                # None: <run_dir>/checkpoints
    keep: int                      # complete checkpoints kept; 0 keeps all
    resume: str | None             # train.resume: "auto", a checkpoint folder, or None

    def root(self, run_dir: Path) -> Path:
        """Where the checkpoints of a run in ``run_dir`` go."""
        return Path(self.dir) if self.dir else default_checkpoint_root(run_dir)

    @classmethod
    def from_config(cls, cfg: Any) -> CheckpointSpec:
        checkpoint = Section(cfg, "checkpoint")
        return cls(every=checkpoint.integer("every", 0), at_end=checkpoint.flag("at_end"),
                   dir=checkpoint.optional_text("dir"),
                   keep=checkpoint.integer("keep", 0), resume=Section(cfg, "train").optional_text("resume"))


@dataclass(frozen=True)
class TraceSpec:
    enabled: bool | str            # true | false | "auto" (on for short runs, see trace.traced_steps)
    steps: tuple[int, ...] | None  # 1-based iterations; None: the few after warm-up
    timeline: bool

    @classmethod
    def from_config(cls, cfg: Any) -> TraceSpec:
        trace = Section(cfg, "trace")
        enabled = trace.raw("enabled")
        if enabled != "auto" and not isinstance(enabled, bool):
            raise ConfigError(f"trace.enabled = {enabled!r} must be true, false or auto")
        steps = trace.raw("steps")
        if steps is not None:
            steps = (steps,) if isinstance(steps, int) else tuple(steps)
            if not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
                raise ConfigError(f"trace.steps = {list(steps)} must be iteration numbers, e.g. [10, 11]")
        return cls(enabled=enabled, steps=steps, timeline=trace.flag("timeline"))
