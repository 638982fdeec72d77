"""The plan file: the single contract between the planner and the runtime (docs/planner.md,
"The plan file").

The planner writes it and the runtime reads it. It imports neither (only the standard library and
the schedule registry, which names the schedules a plan may hold), so the runtime never depends on
the planner.

``load_plan(path)`` validates everything the runtime relies on and raises ``PlanError`` with one
line naming the field, the rule and a way out. Extra top-level keys (``planner``: algorithm, reason,
simulator check) are informational.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipedream.schedules.registry import SCHEDULE_INFOS

PLAN_VERSION = 1
SCHEDULES = tuple(SCHEDULE_INFOS)
RECOMPUTE = ("none", "full", "selective")
ZERO_NAMES = ("false", "zero1", "zero2", "zero3")   # optim.distributed for ZeRO level 0..3


class PlanError(ValueError):
    """A plan file is unreadable, inconsistent, or does not match the launch."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    num_layers: int
    num_parameters: int


@dataclass(frozen=True)
class ClusterInfo:
    name: str
    num_devices: int
    devices_per_node: int


@dataclass(frozen=True)
class Parallel:
    pp: int
    tp: int
    dp: int
    vpp: int = 1


@dataclass(frozen=True)
class Batch:
    global_batch: int  # "global" in JSON
    micro: int
    num_microbatches: int  # per pipeline (per input-stage replica) per iteration


@dataclass(frozen=True)
class Stage:
    layers: tuple[int, int]  # [start, end) of the model's layer list
    replicas: int
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Predicted:
    iteration_time_s: float
    samples_per_s: float
    tflops_per_device: float
    bubble_fraction: float
    memory_bytes_per_device: float
    memory_capacity_bytes: float = 0.0


@dataclass(frozen=True)
class Harmony:
    """A ``harmony_pp`` plan's configuration in the runtime's terms (``conf/schedule/harmony_pp.yaml``):
    forward and backward layer packs ([start, end) each, both covering the model and ending with the
    same jit pack), micro-batches per forward / backward task group, ``devices`` devices of
    ``device_budget_bytes`` each. The micro-batch size is ``batch.micro``; ``stages`` is empty."""

    forward_packs: tuple[tuple[int, int], ...]
    backward_packs: tuple[tuple[int, int], ...]
    forward_group: int
    backward_group: int
    devices: int
    device_budget_bytes: float

    def to_json(self) -> dict[str, Any]:
        return {"forward_packs": [list(p) for p in self.forward_packs],
                "backward_packs": [list(p) for p in self.backward_packs], "forward_group": self.forward_group,
                "backward_group": self.backward_group, "devices": self.devices,
                "device_budget_bytes": self.device_budget_bytes}


@dataclass(frozen=True)
class Plan:
    """Virtual stage j of ``stages`` runs on pipeline rank j % pp as chunk j // pp."""

    model: ModelInfo
    cluster: ClusterInfo
    parallel: Parallel
    schedule: str
    batch: Batch
    recompute: str
    stages: tuple[Stage, ...]
    predicted: Predicted
    alternatives: tuple[dict[str, Any], ...] = ()
    planner: dict[str, Any] = field(default_factory=dict)
    version: int = PLAN_VERSION
    precision: str | None = None   # what the memory and time were predicted for; None in older plans
    harmony: Harmony | None = None  # schedule harmony_pp only
    sequence_parallel: bool = False      # parallel.sequence_parallel (absent in older plans: false)
    distributed_optimizer: bool = False  # optim.distributed (absent in older plans: false)
    recompute_layers: int | None = None  # recompute.num_layers (absent: null, every layer)
    context_parallel: int = 1            # parallel.cp (absent in older plans: 1)
    zero: int = 0                        # ZeRO level, optim.distributed (older plans: 1 if distributed_optimizer)
    reshard_after_forward: bool = False  # optim.reshard_after_forward (zero 3 only; absent in older plans: false)
    expert_parallel: int = 1             # parallel.ep: MoE experts split over ep of the d*cp ranks (absent: 1)

    @property
    def world_size(self) -> int:
        """Processes the plan needs: tp x cp x the replicas of every pipeline stage (pp * tp * dp * cp when uniform)."""
        if self.harmony is not None:
            return self.harmony.devices
        return self.parallel.tp * self.context_parallel * sum(st.replicas for st in self.stages[: self.parallel.pp])

    @property
    def optim_distributed(self) -> bool | str:
        """optim.distributed as the plan's ZeRO level sets it: false, true (zero1's alias, which every
        runtime reads), zero2 or zero3."""
        return {0: False, 1: True}.get(self.zero, ZERO_NAMES[self.zero])

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise PlanError(f"the plan needs {self.world_size} processes (pp*tp*dp*cp = {self.parallel.pp}*"
                            f"{self.parallel.tp}*{self.parallel.dp}*{self.context_parallel}) but WORLD_SIZE = {world_size}: launch "
                            f"{self.world_size} processes (python -m launcher parallel.plan=... does) or re-plan "
                            f"for {world_size} devices")

    def to_json(self) -> dict[str, Any]:
        extra = {"harmony": self.harmony.to_json()} if self.harmony is not None else {}
        return {
            "version": self.version,
            "model": vars(self.model), "cluster": vars(self.cluster), "parallel": vars(self.parallel),
            "schedule": self.schedule,
            "batch": {"global": self.batch.global_batch, "micro": self.batch.micro,
                      "num_microbatches": self.batch.num_microbatches},
            "recompute": self.recompute,
            "sequence_parallel": self.sequence_parallel,
            "distributed_optimizer": self.distributed_optimizer,
            "context_parallel": self.context_parallel, "zero": self.zero,
            "reshard_after_forward": self.reshard_after_forward, "expert_parallel": self.expert_parallel,
            **({"recompute_num_layers": self.recompute_layers} if self.recompute_layers is not None else {}),
            "precision": self.precision,
            "stages": [{"layers": list(st.layers), "replicas": st.replicas, "ranks": list(st.ranks)}
                       for st in self.stages],
            "predicted": vars(self.predicted),
            "alternatives": list(self.alternatives),
            "planner": dict(self.planner),
            **extra,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def _need(data: dict, key: str, kind: type, where: str = "") -> Any:
    if not isinstance(data, dict) or key not in data:
        raise PlanError(f"plan is missing {where}{key}: write it with `python -m planner ... planner.out=plan.json`")
    value = data[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise PlanError(f"plan {where}{key} = {value!r} must be an integer")
    if kind is not int and not isinstance(value, kind):
        raise PlanError(f"plan {where}{key} = {value!r} must be a {kind.__name__}")
    return value


def plan_from_json(data: Any) -> Plan:
    """Build and validate a Plan from its JSON form."""
    if not isinstance(data, dict):
        raise PlanError("plan must be a JSON object")
    version = _need(data, "version", int)
    if version != PLAN_VERSION:
        raise PlanError(f"plan version = {version} but this runtime reads version {PLAN_VERSION}: re-plan")
    m, c, par, bt = (_need(data, k, dict) for k in ("model", "cluster", "parallel", "batch"))
    model = ModelInfo(str(_need(m, "name", str, "model.")), _need(m, "num_layers", int, "model."),
                      int(m.get("num_parameters", 0)))
    cluster = ClusterInfo(str(c.get("name", "")), _need(c, "num_devices", int, "cluster."),
                          int(c.get("devices_per_node", 1)))
    parallel = Parallel(*(_need(par, k, int, "parallel.") for k in ("pp", "tp", "dp")), int(par.get("vpp", 1)))
    for name, value in vars(parallel).items():
        if value < 1:
            raise PlanError(f"plan parallel.{name} = {value} must be >= 1")
    schedule = _need(data, "schedule", str)
    if schedule not in SCHEDULE_INFOS:
        raise PlanError(f"plan schedule = {schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    recompute = _need(data, "recompute", str)
    if recompute not in RECOMPUTE:
        raise PlanError(f"plan recompute = {recompute!r} is unknown; choose one of {', '.join(RECOMPUTE)}")
    batch = Batch(*(_need(bt, k, int, "batch.") for k in ("global", "micro", "num_microbatches")))
    stages = tuple(_stage(s, i) for i, s in enumerate(_need(data, "stages", list)))
    pred = data.get("predicted") or {}
    predicted = Predicted(**{k: float(pred.get(k, 0.0)) for k in Predicted.__dataclass_fields__})
    harmony = _harmony(_need(data, "harmony", dict)) if SCHEDULE_INFOS[schedule].memory_virtualised else None
    savers = {}
    for key in ("sequence_parallel", "distributed_optimizer"):
        value = data.get(key, False)
        if not isinstance(value, bool):
            raise PlanError(f"plan {key} = {value!r} must be true or false")
        savers[key] = value
    layers = data.get("recompute_num_layers")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 0
                               or recompute == "none"):
        raise PlanError(f"plan recompute_num_layers = {layers!r} must be an integer >= 0 with recompute full or "
                        f"selective (got recompute = {recompute!r}), or absent")
    savers["recompute_layers"] = layers
    savers["context_parallel"] = _context_parallel(data)
    savers["zero"] = _zero(data, savers["distributed_optimizer"])
    savers["reshard_after_forward"] = _reshard(data, savers["zero"])
    savers["expert_parallel"] = _expert_parallel(data, parallel.dp * savers["context_parallel"])
    plan = Plan(model, cluster, parallel, schedule, batch, recompute, stages, predicted,
                tuple(data.get("alternatives") or ()), dict(data.get("planner") or {}), version,
                data.get("precision"), harmony, **savers)
    if harmony is not None:
        _validate_harmony(plan, harmony)
    else:
        _validate(plan)
    return plan


def _context_parallel(data: dict) -> int:
    cp = data.get("context_parallel", 1)
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise PlanError(f"plan context_parallel = {cp!r} must be an integer >= 1 (parallel.cp), or absent for 1")
    return cp


def _expert_parallel(data: dict, ranks: int) -> int:
    """parallel.ep: it takes its ranks from the d*cp data- and context-parallel ranks of a stage."""
    ep = data.get("expert_parallel", 1)
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or ranks % ep:
        raise PlanError(f"plan expert_parallel = {ep!r} must be an integer >= 1 dividing dp*cp = {ranks} "
                        f"(parallel.ep), or absent for 1")
    return ep


def _zero(data: dict, distributed_optimizer: bool) -> int:
    """The ZeRO level: ``zero`` as 0..3 or its optim.distributed name; a plan without it (older
    plans) has level 1 where ``distributed_optimizer`` is true. The two must agree where both are given."""
    raw = data.get("zero")
    if raw is None:
        return 1 if distributed_optimizer else 0
    names = {name: level for level, name in enumerate(ZERO_NAMES)}
    level = raw if isinstance(raw, int) and not isinstance(raw, bool) else names.get(raw) if isinstance(raw, str) else None
    if level not in (0, 1, 2, 3):
        raise PlanError(f"plan zero = {raw!r} must be 0, 1, 2 or 3 (or false, zero1, zero2, zero3)")
    if "distributed_optimizer" in data and distributed_optimizer != (level >= 1):
        raise PlanError(f"plan zero = {raw!r} but distributed_optimizer = {str(distributed_optimizer).lower()}: "
                        f"distributed_optimizer must be true exactly for ZeRO levels 1 to 3; re-plan or fix one of them")
    return level


def _reshard(data: dict, zero: int) -> bool:
    """optim.reshard_after_forward: a ZeRO-3 choice (one chunk's parameters whole at a time)."""
    value = data.get("reshard_after_forward", False)
    if not isinstance(value, bool):
        raise PlanError(f"plan reshard_after_forward = {value!r} must be true or false, or absent for false")
    if value and zero != 3:
        raise PlanError(f"plan reshard_after_forward = true needs zero = 3 (got zero = {zero}): it frees ZeRO-3's "
                        f"gathered parameters after each action; re-plan or set it false")
    return value


def _packs(raw: Any, name: str) -> tuple[tuple[int, int], ...]:
    if not isinstance(raw, list) or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) for x in p)
                                            for p in raw):
        raise PlanError(f"plan harmony.{name} = {raw!r} must be a list of [start, end) layer ranges")
    return tuple((p[0], p[1]) for p in raw)


def _harmony(raw: Any) -> Harmony:
    where = "harmony."
    budget = _need(raw, "device_budget_bytes", object, where)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise PlanError(f"plan harmony.device_budget_bytes = {budget!r} must be a positive number of bytes")
    return Harmony(_packs(_need(raw, "forward_packs", list, where), "forward_packs"),
                   _packs(_need(raw, "backward_packs", list, where), "backward_packs"),
                   _need(raw, "forward_group", int, where), _need(raw, "backward_group", int, where),
                   _need(raw, "devices", int, where), float(budget))


def _validate_harmony(plan: Plan, h: Harmony) -> None:
    """Both pack lists split [0, layers) in order and end with the same (jit) pack; groups fit the
    iteration's micro-batches; the batch splits into micro-batches."""
    layers = plan.model.num_layers
    for name, packs in (("forward_packs", h.forward_packs), ("backward_packs", h.backward_packs)):
        start = 0
        for s, e in packs:
            if s != start or e <= s:
                raise PlanError(f"plan harmony.{name} = {[list(p) for p in packs]} must split [0, {layers}) into "
                                f"non-empty ranges in order")
            start = e
        if start != layers:
            raise PlanError(f"plan harmony.{name} covers [0, {start}) but the model has {layers} layers")
    if h.forward_packs[-1] != h.backward_packs[-1]:
        raise PlanError(f"plan harmony: the last forward pack {list(h.forward_packs[-1])} and the last backward pack "
                        f"{list(h.backward_packs[-1])} must be the same (the jit pack)")
    b = plan.batch
    if b.global_batch != b.micro * b.num_microbatches:
        raise PlanError(f"plan batch.global = {b.global_batch} must equal micro * num_microbatches = "
                        f"{b.micro}*{b.num_microbatches} (harmony_pp has no data parallelism)")
    for name, group in (("forward_group", h.forward_group), ("backward_group", h.backward_group), ("devices", h.devices)):
        if group < 1 or (name != "devices" and group > b.num_microbatches):
            raise PlanError(f"plan harmony.{name} = {group} must be between 1 and "
                            f"{b.num_microbatches if name != 'devices' else 'the devices'}")


def _stage(raw: Any, i: int) -> Stage:
    layers = _need(raw, "layers", list, f"stages[{i}].")
    if len(layers) != 2 or not all(isinstance(x, int) for x in layers):
        raise PlanError(f"plan stages[{i}].layers = {layers!r} must be [start, end)")
    ranks = raw.get("ranks") or []
    return Stage((layers[0], layers[1]), _need(raw, "replicas", int, f"stages[{i}]."), tuple(int(r) for r in ranks))


def _validate(plan: Plan) -> None:
    par, stages = plan.parallel, plan.stages
    if len(stages) != par.pp * par.vpp:
        raise PlanError(f"plan has {len(stages)} stages but pp*vpp = {par.pp}*{par.vpp}: one entry per virtual stage")
    start = 0
    for i, st in enumerate(stages):
        if st.layers[0] != start or st.layers[1] <= st.layers[0]:
            raise PlanError(f"plan stages[{i}].layers = {list(st.layers)} must start at {start} and be non-empty: "
                            f"stages split [0, {plan.model.num_layers}) in order")
        start = st.layers[1]
    if start != plan.model.num_layers:
        raise PlanError(f"plan stages cover layers [0, {start}) but the model has {plan.model.num_layers}")
    if not SCHEDULE_INFOS[plan.schedule].replicated_stages and any(st.replicas != par.dp for st in stages):
        raise PlanError(f"plan replicas {[st.replicas for st in stages]} must all equal parallel.dp = {par.dp}; "
                        f"only the pipedream schedule replicates stages unevenly")
    if plan.batch.global_batch != plan.batch.micro * plan.batch.num_microbatches * stages[0].replicas:
        raise PlanError(f"plan batch.global = {plan.batch.global_batch} must equal micro * num_microbatches * dp = "
                        f"{plan.batch.micro}*{plan.batch.num_microbatches}*{stages[0].replicas}")
    seen: set[int] = set()
    for j, st in enumerate(stages):
        if not st.ranks:
            continue
        if len(st.ranks) != st.replicas * par.tp * plan.context_parallel:
            raise PlanError(f"plan stages[{j}] lists {len(st.ranks)} ranks for {st.replicas} replicas x tp {par.tp} "
                            f"x cp {plan.context_parallel}")
        if j >= par.pp:
            if st.ranks != stages[j % par.pp].ranks:
                raise PlanError(f"plan stages[{j}] (chunk {j // par.pp} of pipeline rank {j % par.pp}) must list "
                                f"the same ranks as stages[{j % par.pp}]")
            continue
        if seen & set(st.ranks):
            raise PlanError(f"plan stages[{j}] reuses ranks {sorted(seen & set(st.ranks))[:4]}")
        seen |= set(st.ranks)
    if seen and seen != set(range(plan.world_size)):
        raise PlanError(f"plan ranks must be 0..{plan.world_size - 1}, each in one pipeline stage")


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file (PlanError, one line, on any problem)."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise PlanError(f"cannot read plan file {path}: {err.strerror or err}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise PlanError(f"plan file {path} is not JSON ({err.msg} at line {err.lineno})") from None
    return plan_from_json(data)
