"""Applies a planner plan file (``parallel.plan=plan.json``) to the training config: the plan's
degrees, schedule, batch sizes, recomputation and layer split replace the config's."""
from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf, open_dict

from pipedream.config.loading import config_dir
from pipedream.errors import ConfigError
from pipedream.config.plan_file import PlanError, load_plan
from models import layer_count, plugin_target
from models.facts import parameter_count
from pipedream.schedules import schedule_info


def apply_plan(cfg: Any, plugin: Any = None, model_label: str | None = None) -> Any:
    """Returns ``cfg`` unchanged without a plan, else a copy carrying the plan's choices. ``plugin``:
    the model plugin as ``models.checked_plugin`` read it (read here when not given). ``model_label``:
    the model as the user chose it (``model=llama_tiny``), checked against the plan's where given."""
    path = cfg.parallel.get("plan")
    if not path:
        return cfg
    try:
        plan = load_plan(str(path))
    except PlanError as error:
        raise ConfigError(str(error)) from None
    chunks = schedule_info(plan.schedule).fixed_chunks
    if chunks and plan.parallel.vpp != chunks:
        raise ConfigError(f"plan {path} prices schedule={plan.schedule} as one stage per rank and does not split each "
                          f"rank's layers into the V's two chunks: train it with schedule={plan.schedule} parallel.pp="
                          f"{plan.parallel.pp} without parallel.plan")
    expected_layers = layer_count(cfg.model, plugin)
    if plan.model.num_layers != expected_layers:
        label = cfg.model.get("name") or cfg.model.get("_target_")
        raise ConfigError(f"plan {path} splits {plan.model.num_layers} layers but model={label} has "
                          f"{expected_layers} pipeline layers: plan for this model (python -m planner model=...)")
    check_plan_matches_run(plan, str(path), cfg, model_label)
    planned = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    if plan.harmony is not None:
        return _apply_harmony(planned, plan, str(path))
    with open_dict(planned):
        planned.parallel.pp, planned.parallel.tp = plan.parallel.pp, plan.parallel.tp
        planned.parallel.dp, planned.parallel.vpp = plan.parallel.dp, plan.parallel.vpp
        planned.parallel.layers_per_stage = [end - start for start, end in (st.layers for st in plan.stages)]
        replicas = [st.replicas for st in plan.stages[:plan.parallel.pp]]
        if len(set(replicas)) > 1:
            planned.parallel.stage_replicas = replicas
        planned.schedule.name = plan.schedule
        planned.train.global_batch_size = plan.batch.global_batch
        planned.train.micro_batch_size = plan.batch.micro
        planned.recompute.granularity = plan.recompute
        planned.recompute.num_layers = plan.recompute_layers
        planned.parallel.sequence_parallel = plan.sequence_parallel
        planned.parallel.cp = plan.context_parallel
        planned.parallel.ep = plan.expert_parallel
        planned.optim.distributed = plan.optim_distributed   # the ZeRO level the memory was priced with
        planned.optim.reshard_after_forward = plan.reshard_after_forward
        if plan.precision is not None and plan.precision != OmegaConf.select(planned, "precision.name"):
            planned.precision = _precision_group(plan.precision, str(path))
    return planned


def check_plan_matches_run(plan: Any, path: str, cfg: Any, model_label: str | None = None) -> None:
    """A plan prices one model at one global batch: another model (its name, or its parameter count
    where the family can count it) or another ``train.global_batch_size`` is refused, not trained
    silently with the plan's layout."""
    fix = "pass the overrides the planner's `run it with` line repeats, or re-plan for this run"
    planned = plan.model.name
    if model_label is not None and not planned.startswith("graph:") and planned != model_label:
        raise ConfigError(f"plan {path} was made for model={planned} but this run trains model={model_label}: {fix}")
    if plugin_target(cfg.model) is None and not planned.startswith("graph:"):
        count = parameter_count(cfg.model)
        if count != plan.model.num_parameters:
            raise ConfigError(f"plan {path} was made for a {planned} of {plan.model.num_parameters:,} parameters but "
                              f"this run's model has {count:,} (a model.* setting differs): {fix}")
    batch = cfg.train.global_batch_size
    if batch != plan.batch.global_batch:
        raise ConfigError(f"plan {path} was made for train.global_batch_size={plan.batch.global_batch} but this run "
                          f"sets {batch}: pass train.global_batch_size={plan.batch.global_batch}, or re-plan with "
                          f"train.global_batch_size={batch}")


def _apply_harmony(planned: Any, plan: Any, path: str) -> Any:
    """A harmony_pp plan: the schedule group ``conf/schedule/harmony_pp.yaml`` with the plan's packs
    (as layers per pack) and groups, one device per process, the batch and the device budget."""
    h = plan.harmony
    with open_dict(planned):
        planned.schedule = OmegaConf.load(config_dir() / "schedule" / "harmony_pp.yaml")
        planned.schedule.forward_packs = [end - start for start, end in h.forward_packs]
        planned.schedule.backward_packs = [end - start for start, end in h.backward_packs]
        planned.schedule.forward_group, planned.schedule.backward_group = h.forward_group, h.backward_group
        planned.parallel.pp, planned.parallel.tp, planned.parallel.dp, planned.parallel.vpp = h.devices, 1, 1, 1
        planned.parallel.layers_per_stage = None
        planned.train.global_batch_size = plan.batch.global_batch
        planned.train.micro_batch_size = plan.batch.micro
        planned.memory.device_budget_bytes = int(h.device_budget_bytes)
        if plan.precision is not None and plan.precision != OmegaConf.select(planned, "precision.name"):
            planned.precision = _precision_group(plan.precision, path)
    return planned


def _precision_group(name: str, path: str) -> Any:
    """The plan's precision, with that option's settings from conf/precision/ (e.g. fp16's scaler)."""
    option = config_dir() / "precision" / f"{name}.yaml"
    if not option.is_file():
        raise ConfigError(f"plan {path} was made for precision {name}, which training does not run: re-plan with "
                          f"planner.precision=bf16, fp16 or fp32")
    return OmegaConf.load(option)


def check_plan_world_size(cfg: Any, world_size: int) -> None:
    path = cfg.parallel.get("plan")
    if path:
        try:
            load_plan(str(path)).check_world_size(world_size)
        except PlanError as error:
            raise ConfigError(str(error)) from None
