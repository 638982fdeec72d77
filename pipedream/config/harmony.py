"""Reads and checks ``schedule=harmony_pp``'s and ``schedule=harmony_dp``'s settings
(conf/schedule/harmony_*.yaml and ``memory.device_budget_bytes``) before any process group, and
refuses, one line each, what the Harmony runtime does not compose with. No torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from models.registry import known_family

from pipedream.errors import ConfigError
from pipedream.config.layout import ParallelLayout
from pipedream.schedules import ScheduleError
from pipedream.schedules.harmony import FORWARD, HarmonyConfig, harmony_config
from pipedream.schedules.info import ScheduleInfo
from pipedream.config.specs import Section

PACK_KEYS = ("forward_packs", "backward_packs")
GROUP_KEYS = ("forward_group", "backward_group")


@dataclass(frozen=True)
class HarmonySpec:
    config: HarmonyConfig
    device_budget_bytes: int | None   # None: the device's capacity
    delay_updates: bool = False       # schedule.clip_delays_updates: every update waits for the global norm
    replicas: int = 1                 # harmony_dp: devices that each run every pack (config.devices is 1)


def _sizes(section: Section, key: str) -> list[int] | None:
    value = section.raw(key)
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"schedule.{key} = {value!r} must be a list of layers per pack, e.g. [2,2,1], or null")
    return list(value)


def _budget(cfg: Any) -> int | None:
    value = Section(cfg, "memory").raw("device_budget_bytes")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"memory.device_budget_bytes = {value!r} must be a positive number of bytes or null "
                          f"(the device's capacity)")
    return value


def _refusals(cfg: Any, layout: ParallelLayout, precision: str, info: ScheduleInfo) -> None:
    """What harmony_pp / harmony_dp do not run, each with the way out."""
    def get(dotted: str) -> Any:
        return OmegaConf.select(cfg, dotted, default=None)

    family = known_family(get("model.name"))
    checks = [
        (layout.tp > 1, f"parallel.tp = {layout.tp}", "set parallel.tp=1"),
        (layout.dp > 1 and not info.replicated_packs, f"parallel.dp = {layout.dp}",
         "set parallel.dp=1 (every device takes part in one wrap-around pipeline) or use schedule=harmony_dp"),
        (layout.pp > 1 and info.replicated_packs, f"parallel.pp = {layout.pp}",
         "set parallel.pp=1 and parallel.dp to the device count (every device runs every pack)"),
        (layout.vpp > 1, f"parallel.vpp = {layout.vpp}", "set parallel.vpp=1 (packs replace chunks)"),
        (bool(layout.stage_replicas), "parallel.stage_replicas", "leave it null"),
        (precision == "fp16", "precision=fp16", "use precision=bf16 (no loss scaling needed) or fp32 (packs are "
                                                 "updated before an overflow anywhere else could skip the step)"),
        ((get("train.grad_clip") or 0) > 0 and get("schedule.clip_delays_updates") is not True
         and not info.replicated_packs,
         f"train.grad_clip = {get('train.grad_clip')} without schedule.clip_delays_updates=true",
         "set schedule.clip_delays_updates=true (every pack's update waits for the global gradient norm, at the end "
         "of the iteration) or train.grad_clip=0 (each pack is updated right after its backward)"),
        (family is not None and family.batch_norm, f"model={get('model.name')}",
         "use model=vgg16 or a GPT (BatchNorm statistics would be updated again by the recompute)"),
        (get("model._target_") is not None, "model._target_", "use a built-in model"),
    ]
    for refused, what, fix in checks:
        if refused:
            raise ConfigError(f"{what} is not supported with schedule={info.name}: {fix}")


def harmony_spec(cfg: Any, layout: ParallelLayout, num_layers: int, microbatches: int, precision: str,
                 info: ScheduleInfo) -> HarmonySpec:
    """The validated configuration; ConfigError (one line) otherwise. harmony_dp's configuration
    is one device's (every task on it) over that device's ``microbatches``."""
    _refusals(cfg, layout, precision, info)
    replicas = layout.dp if info.replicated_packs else 1
    section = Section(cfg, "schedule")
    groups = {}
    for key in GROUP_KEYS:
        value = section.raw(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"schedule.{key} = {value!r} must be a number of micro-batches or null (all of them)")
        groups[key] = value
    try:
        config = harmony_config(num_layers, microbatches, 1 if info.replicated_packs else layout.pp,
                                _sizes(section, "forward_packs"), _sizes(section, "backward_packs"), **groups)
    except ScheduleError as error:
        raise ConfigError(f"schedule={info.name}: {error} (schedule.forward_packs, schedule.backward_packs, "
                          f"schedule.forward_group, schedule.backward_group)") from None
    _check_checkpoints(cfg, config, replicas, info.name)
    budget = _budget(cfg)
    if budget is not None:
        _check_packs_fit(cfg, config, budget)
    delay = section.raw("clip_delays_updates")
    if delay is not None and not isinstance(delay, bool):
        raise ConfigError(f"schedule.clip_delays_updates = {delay!r} must be true or false")
    return HarmonySpec(config, budget, bool(delay) or replicas > 1, replicas)


def _check_checkpoints(cfg: Any, config: HarmonyConfig, replicas: int, name: str) -> None:
    """A checkpoint holds each layer's state from its owner. harmony_pp: the device of its backward;
    the owning tasks are the last len(P_B) of P_FB, consecutive round the devices, so every device
    owns a layer iff there are at least as many backward packs as devices. harmony_dp: layer l is
    owned by device l mod parallel.dp."""
    wanted = (OmegaConf.select(cfg, "checkpoint.every", default=0) or 0) > 0 or \
        OmegaConf.select(cfg, "train.resume", default=None) is not None
    if wanted and config.num_layers < replicas:
        raise ConfigError(f"checkpoints with schedule={name} need at least one layer per device: the model has "
                          f"{config.num_layers} for parallel.dp = {replicas}; use fewer devices or set "
                          f"checkpoint.every=0 and train.resume=null")
    if wanted and len(config.backward_packs) < config.devices:
        raise ConfigError(f"checkpoints with schedule={name} need at least parallel.pp = {config.devices} backward "
                          f"packs, so every device owns a layer; schedule.backward_packs has "
                          f"{len(config.backward_packs)}: split it further or set checkpoint.every=0 and "
                          f"train.resume=null")


def _check_packs_fit(cfg: Any, config: HarmonyConfig, budget: int) -> None:
    """Every task needs its pack's weights (and, for a backward, their gradients) on the device
    at once: a budget below that is refused before anything starts (sizes from the meta device)."""
    import torch   # only here: the other checks need no torch

    from models import build_model

    with torch.device("meta"):
        layers = build_model(cfg.model, seed=0).build()
    sizes = [sum(p.numel() * p.element_size() for p in layers[i].parameters()) for i in range(config.num_layers)]
    for task in config.tasks:
        first, stop = task.layers
        need = sum(sizes[first:stop]) * (1 if task.role == FORWARD else 2)
        if need > budget:
            what = "weights" if task.role == FORWARD else "weights and gradients"
            raise ConfigError(f"memory.device_budget_bytes = {budget} is below the {need} bytes of {what} that task "
                              f"{task.index} ({task.role}, layers [{first}, {stop})) holds at once: raise it to at "
                              f"least {need} or split that pack (schedule.forward_packs, schedule.backward_packs)")
