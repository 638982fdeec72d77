"""Elastic training's settings, and the layout a world of another size runs (torch-free: the launcher
reads it too; how a job re-forms: docs/reliability.md).

``launcher.min_nodes`` below ``launcher.nnodes`` makes a job elastic: torchrun re-forms it with any
node count in between, and each (re)start may see a world size other than the configured degrees'.
The layout for that world is a pure function of the config and the world size, so every rank computes
the same one without a word exchanged: the nearest layout whose pipeline x tensor degrees fit the
devices (the configured ones where they fit), data parallelism filling the rest, and gradient
accumulation (more micro-batches per step) keeping ``train.global_batch_size``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from pipedream.errors import ConfigError
from pipedream.schedules import ScheduleError, schedule_info

WORLD_ROUND = "PIPEDREAM_WORLD_ROUND"   # the rendezvous round, as launcher.elastic_agent tells the ranks
REFORM_SIGNAL = "USR2"   # the launch agent asks its ranks to checkpoint and re-form (a node joined)
ELASTIC_PLANS = "PIPEDREAM_ELASTIC_PLANS"   # the folder of a plan-file run's per-world plans (launcher.elastic_plans)


@dataclass(frozen=True)
class ElasticSpec:
    min_nodes: int
    nnodes: int

    @property
    def enabled(self) -> bool:
        return self.min_nodes < self.nnodes

    @classmethod
    def from_config(cls, cfg: Any) -> ElasticSpec:
        launcher = cfg.get("launcher") or {}
        nnodes = int(launcher.get("nnodes") or 1)
        min_nodes = launcher.get("min_nodes")
        if min_nodes is None:
            return cls(nnodes, nnodes)
        if not isinstance(min_nodes, int) or isinstance(min_nodes, bool) or not 1 <= min_nodes <= nnodes:
            raise ConfigError(f"launcher.min_nodes = {min_nodes!r} must be a node count in 1..launcher.nnodes "
                              f"(= {nnodes}): the fewest nodes the job keeps training on; null: not elastic")
        return cls(min_nodes, nnodes)


def check_elastic(cfg: Any) -> ElasticSpec:
    """The elastic settings, refused in one line where a re-formed run could not continue exactly."""
    spec = ElasticSpec.from_config(cfg)
    every = OmegaConf.select(cfg, "checkpoint.in_memory_every")
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 0):
        raise ConfigError(f"checkpoint.in_memory_every = {every!r} must be an integer >= 0 (steps between in-memory "
                          f"copies on a peer node; 0: off)")
    if not spec.enabled:
        return spec
    schedule = str(OmegaConf.select(cfg, "schedule.name"))
    try:
        info = schedule_info(schedule)
    except ScheduleError:   # an unknown name: the run's own check refuses it
        info = None
    # weight versions in flight, or memory virtualised: their resume across layouts is not exact
    if info is not None and (info.asynchronous or info.memory_virtualised):
        raise ConfigError(f"launcher.min_nodes = {spec.min_nodes} (elastic) with schedule={schedule} is refused: its "
                          f"resume is not exact across layouts; use a synchronous schedule (1f1b, gpipe, "
                          f"interleaved, zb_h2, zbv) or leave launcher.min_nodes unset")
    if str(OmegaConf.select(cfg, "preemption.signal") or "").upper().removeprefix("SIG") == REFORM_SIGNAL:
        raise ConfigError(f"preemption.signal={REFORM_SIGNAL} with launcher.min_nodes (elastic) is refused: an elastic "
                          f"job uses SIG{REFORM_SIGNAL} to re-form when a node joins; use preemption.signal=USR1")
    if OmegaConf.select(cfg, "parallel.stage_replicas"):
        raise ConfigError("parallel.stage_replicas with launcher.min_nodes (elastic) is refused: per-stage replica "
                          "counts cannot be re-planned; use parallel.dp")
    return spec


def configured_world(cfg: Any) -> int:
    parallel = cfg.parallel
    return int(parallel.pp) * int(parallel.tp) * int(parallel.get("cp") or 1) * int(parallel.dp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_degrees(pp: int, tp: int, cp: int, world: int) -> list[tuple[int, int, int]]:
    """(pp, tp, dp) for ``world`` devices, nearest first: the largest pipeline x tensor product up to
    the configured one (per-device memory stays as close as it can), tensor degrees dividing the
    configured one (head counts stay divisible), ties broken towards the configured tensor degree."""
    found = []
    for new_tp in _divisors(tp):
        for new_pp in range(1, pp + 1):
            model_parallel = new_pp * new_tp * cp
            if world % model_parallel == 0:
                found.append((new_pp, new_tp, world // model_parallel))
    return sorted(found, key=lambda d: (-(d[0] * d[1]), -d[1], -d[0]))


def resuming_copy(cfg: Any) -> Any:
    """A copy of ``cfg`` that resumes from the run's newest complete checkpoint: every attempt of an
    elastic run does (a node that joins late must agree with the others; the launcher has claimed,
    or cleared, the run directory)."""
    copy = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    OmegaConf.set_struct(copy, False)
    copy.train.resume, copy.train.overwrite = "auto", False
    return copy


def relaid_config(cfg: Any, degrees: tuple[int, int, int]) -> Any:
    """A copy of ``cfg`` with these (pp, tp, dp); an explicit layer split of another stage count goes."""
    pp, tp, dp = degrees
    relaid = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    OmegaConf.set_struct(relaid, False)
    relaid.parallel.pp, relaid.parallel.tp, relaid.parallel.dp = pp, tp, dp
    split = relaid.parallel.get("layers_per_stage")
    if split is not None and len(split) != pp * int(relaid.parallel.get("vpp") or 1):
        relaid.parallel.layers_per_stage = None
    if tp == 1:
        relaid.parallel.sequence_parallel = False
    return relaid


def layout_for_world(cfg: Any, world: int, accepts: Callable[[Any], None]) -> Any:
    """``cfg`` re-laid for ``world`` devices: the first candidate that ``accepts`` (it raises ConfigError
    for one the run cannot take: a global batch the data-parallel degree does not divide, a schedule
    that needs more micro-batches). Raises ConfigError naming every reason when none fits."""
    parallel = cfg.parallel
    pp, tp, cp = int(parallel.pp), int(parallel.tp), int(parallel.get("cp") or 1)
    reasons = []
    for degrees in candidate_degrees(pp, tp, cp, world):
        relaid = relaid_config(cfg, degrees)
        try:
            accepts(relaid)
        except ConfigError as error:
            reasons.append(f"pp={degrees[0]} tp={degrees[1]} dp={degrees[2]}: {error}")
            continue
        return relaid
    detail = "; ".join(reasons) if reasons else f"no pp x tp x cp (cp = {cp}) divides {world}"
    raise ConfigError(f"no layout of {world} devices can continue this elastic run ({detail}): start it on "
                      f"{configured_world(cfg)} devices, or change train.global_batch_size / parallel degrees")


def world_plan_path(folder: Path, world: int) -> Path:
    """Where a plan-file run's plan for a world of ``world`` devices is (``launcher.elastic_plans``)."""
    return folder / f"world_{world}.json"


def planned_for_world(cfg: Any, world: int, folder: str) -> Any:
    """``cfg`` (a resuming copy) training the launcher's plan for ``world`` devices."""
    path = world_plan_path(Path(folder), world)
    if not path.exists():
        raise ConfigError(f"the elastic run re-formed on {world} devices, for which no plan fits (the launcher's "
                          f"'elastic:' lines say which node counts do): restart it on more nodes")
    cfg.parallel.plan = str(path)
    return cfg
