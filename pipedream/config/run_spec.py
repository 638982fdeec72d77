"""Turns the Hydra config into a validated ``RunSpec`` before any process group exists.

Every rule lives here, in the section readers of ``specs.py`` and in ``data_choice.py`` (the data
section), and each failure is one ``ConfigError`` line naming the value, the rule and a way out.
Below the entry point nothing reads the Hydra config again: the model and data sections travel in
``RunSpec.config`` as plain data (``models`` and ``data`` read mappings), beside the run's record.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from models import (check_context_parallel_config, check_expert_parallel_config, check_tensor_parallel_config,
                    checked_plugin, pipeline_layer_count)
from models.plugin_config import plugin_target
from models.registry import MODEL_FAMILIES, model_family

from pipedream.config.apex_check import check_apex
from pipedream.config.balance import estimated_seconds
from pipedream.config.data_choice import check_data_section
from pipedream.config.ep_overlap import ep_overlap_enabled
from pipedream.config.harmony import HarmonySpec, harmony_spec
from pipedream.config.layout import ParallelLayout, split_layers
from pipedream.config.multi_model import check_multi_model
from pipedream.config.precision import PrecisionSpec
from pipedream.config.preemption import PreemptionSpec
from pipedream.config.specs import (CheckpointSpec, LoopSpec, OptimSpec, RecomputeSpec, Section, TraceSpec,
                                    TrainSpec, config_value)
from pipedream.errors import ConfigError
from pipedream.multi_model.spec import MultiModelSpec
from pipedream.schedules import (ScheduleError, ScheduleInfo, build_schedule, pipedream_replicated, schedule_info,
                                 unknown_schedule)

if TYPE_CHECKING:
    from models.plugins import CheckedModel

OPTIMIZERS = ("adamw", "sgd")
RECOMPUTE = ("none", "full", "selective")


@dataclass(frozen=True)
class RunSpec:
    layout: ParallelLayout
    schedule: ScheduleInfo     # .name for printing and output files
    micro_batch: int
    microbatches: int          # per pipeline per iteration (m)
    global_batch: int
    num_layers: int            # pipeline layers of the model (GPT: blocks + 2)
    bounds: tuple[tuple[int, int], ...]   # [start, end) per virtual stage
    recompute: RecomputeSpec   # recompute.granularity and recompute.num_layers
    seq_len: int | None        # tokens per sample (None for the MLP)
    vertical_sync: bool        # pipedream only: every stage uses the input stage's version
    scatter_gather: bool       # tp > 1: boundary tensors travel as 1/t slices (ch. 4.4.1)
    device: str                # cluster.device: cpu | cuda | auto
    plan: str | None           # parallel.plan, the plan file the layout came from
    precision: PrecisionSpec   # precision=fp32|bf16|fp16 (pipedream/numerics/precision.py)
    train: TrainSpec
    optim: OptimSpec
    loop: LoopSpec
    checkpoint: CheckpointSpec
    trace: TraceSpec
    preemption: PreemptionSpec
    multi_model: MultiModelSpec | None   # train.models: a fused model set (None: one model)
    config: dict[str, Any]     # the whole config as plain data, interpolations resolved (the run's record)
    harmony: HarmonySpec | None = None   # schedule=harmony_pp: packs, groups, device budget
    sequence_parallel: bool = False      # parallel.sequence_parallel: 1/t of the sequence between the TP GEMMs
    plugin_forward_flops: float | None = None   # a plugin model's forward FLOPs per sample (counted when checked)
    ep_overlap: bool = False             # parallel.ep_overlap resolved: F+B pairs hide the all-to-all

    @property
    def model_config(self) -> dict[str, Any]:
        """The ``model`` section, as ``models.build_model`` reads it."""
        return self.config["model"]

    @property
    def data_config(self) -> dict[str, Any]:
        """The ``data`` section, as ``pipedream.data.datasets.build_datasets`` reads it."""
        return self.config["data"]


def _positive(cfg: Any, key: str) -> int:
    value = config_value(cfg, key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key} = {value!r} must be a positive integer")
    return value


def _num_layers(cfg: Any, plugin: CheckedModel | None) -> int:
    """The model's pipeline layers: a plugin's as checked, a built-in family's once its keys are."""
    if plugin is not None:
        return plugin.model.num_layers
    name = config_value(cfg, "model.name")
    if name not in MODEL_FAMILIES:
        raise ConfigError(f"model.name={name!r} cannot be trained (planner-only or unknown); "
                          f"trainable: {', '.join(MODEL_FAMILIES)} (e.g. model=gpt_tiny)")
    family = model_family(name)
    for key in family.required_keys:
        _positive(cfg, f"model.{key}")
    family.check_config(cfg.model, config_value(cfg, "train.micro_batch_size"))
    return pipeline_layer_count(cfg.model)


def _layer_costs(cfg: Any, num_layers: int, num_stages: int, counted: tuple | None) -> list[float] | None:
    """Estimated forward seconds per layer for the default split (``config.balance``), where it has
    a choice to make: FLOPs and operators counted on the meta device (hundredths of a second; torch
    is imported here). A built-in model the meta device cannot run gets the even split."""
    if config_value(cfg, "parallel.layers_per_stage") is not None or not 1 < num_stages < num_layers:
        return None
    import torch

    from models import build_model
    from models.plugins import CHECK_BATCH, meta_layer_counts
    if counted is None:
        try:
            with torch.random.fork_rng(devices=[]):   # the caller's random stream stays as it was
                counted = meta_layer_counts(build_model(cfg.model, seed=0), f"model={config_value(cfg, 'model.name')}")
        except Exception:  # noqa: BLE001 - an estimate only; the run itself reports a model that does not build
            return None
    device = str(Section(cfg, "cluster").raw("device"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return estimated_seconds(counted, CHECK_BATCH, int(config_value(cfg, "train.micro_batch_size")), device)


def _check_ties_in_one_stage(cfg: Any, tied: tuple, layout: ParallelLayout, bounds: list, schedule: str) -> None:
    """Asynchronous schedules update stages at different times: a parameter tied across two
    pipeline stages would have two diverging copies."""
    stage_of = [virtual % layout.pp for virtual, (start, end) in enumerate(bounds) for _ in range(start, end)]
    for group in tied:
        stages = sorted({stage_of[layer] for layer, _ in group})
        if len(stages) > 1:
            raise ConfigError(f"model._target_={plugin_target(cfg.model)} ties {group[0][1]} of layer {group[0][0]} "
                              f"to layer {group[1][0]} across stages {stages}, which schedule={schedule} updates at "
                              f"different times: use a flush schedule (1f1b, gpipe, interleaved) or a "
                              f"parallel.layers_per_stage that keeps them on one stage")


def _granularity(cfg: Any) -> str:
    granularity = config_value(cfg, "recompute.granularity")
    if granularity not in RECOMPUTE:
        raise ConfigError(f"recompute.granularity={granularity!r} is not supported: choose one of {', '.join(RECOMPUTE)}")
    return granularity


def _recompute(cfg: Any, granularity: str, plugin: CheckedModel | None, info: ScheduleInfo) -> RecomputeSpec:
    if granularity == "selective":
        _check_selective_recompute(cfg, plugin, info)
    return RecomputeSpec(granularity, _recompute_layers(cfg, granularity, info))


def _recompute_layers(cfg: Any, granularity: str, info: ScheduleInfo) -> int | None:
    """recompute.num_layers (Megatron's --recompute-num-layers, block method): an integer >= 0 where
    something is recomputed, on the flush schedules' plain stages."""
    layers = config_value(cfg, "recompute.num_layers")
    if layers is None:
        return None
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 0:
        raise ConfigError(f"recompute.num_layers = {layers!r} must be an integer >= 0 (layers recomputed at the "
                          f"start of each stage chunk) or null for all")
    if granularity == "none":
        raise ConfigError(f"recompute.num_layers = {layers} needs recompute.granularity=full or selective "
                          f"(got none): set the granularity, or recompute.num_layers=null")
    if info.asynchronous or info.memory_virtualised or config_value(cfg, "train.models") is not None:
        what = f"schedule={info.name}" if info.asynchronous or info.memory_virtualised else "train.models"
        raise ConfigError(f"recompute.num_layers = {layers} with {what}: only the flush schedules' stages "
                          f"recompute part of a chunk; set recompute.num_layers=null")
    return layers


def _check_selective_recompute(cfg: Any, plugin: CheckedModel | None, info: ScheduleInfo) -> None:
    """Selective recomputation needs attention cores to recompute (``models.attention``)."""
    if plugin is not None:
        has_cores = plugin.attention_cores > 0
        what = f"model._target_={plugin_target(cfg.model)} builds no models.CoreAttention"
    else:
        has_cores = model_family(config_value(cfg, "model.name")).attention_core
        what = f"model.name={config_value(cfg, 'model.name')} has no attention"
    if not has_cores:
        raise ConfigError(f"recompute.granularity=selective recomputes attention cores, and {what}: use "
                          f"recompute.granularity=full (or none)")
    if info.memory_virtualised:
        raise ConfigError(f"recompute.granularity=selective with schedule={info.name}: it recomputes whole "
                          f"layers already; use recompute.granularity=none")
    if config_value(cfg, "train.models") is not None:
        raise ConfigError("recompute.granularity=selective with train.models: fused models run their layers under "
                          "torch.vmap, where it does not apply; use recompute.granularity=none or full")


def _check_compile(backend: str | None, info: ScheduleInfo, tp: int, fused: bool) -> None:
    """train.compile runs each layer through torch.compile; where the runtime reaches into a layer's
    parameters or autograd graph itself, it is refused."""
    if backend is None:
        return
    reason = ("its stages run on stashed weight versions" if info.asynchronous else
              "its backward is split into input- and weight-gradient parts" if info.split_backward else
              "it swaps layer packs through host memory" if info.memory_virtualised else None)
    if reason is not None:
        raise ConfigError(f"train.compile={backend} with schedule={info.name}: {reason}, which compiled layers do "
                          f"not support; use a flush schedule (1f1b, gpipe, interleaved) or train.compile=false")
    if tp > 1:
        raise ConfigError(f"train.compile={backend} with parallel.tp={tp}: the tensor-parallel layers' collectives "
                          f"are not compiled; set parallel.tp=1 or train.compile=false")
    if fused:
        raise ConfigError(f"train.compile={backend} with train.models: fused models run their layers under "
                          f"torch.vmap; set train.compile=false")


def _check_sequence_parallel(cfg: Any, tp: Any, plugin: CheckedModel | None) -> bool:
    """parallel.sequence_parallel: a family whose tensor-parallel form supports it, tp > 1, and a
    sequence that splits into t parts."""
    if not Section(cfg, "parallel").flag("sequence_parallel"):
        return False
    if not isinstance(tp, int) or tp < 2:
        raise ConfigError(f"parallel.sequence_parallel=true shards the sequence over the tensor-parallel group, "
                          f"but parallel.tp={tp}: set parallel.tp >= 2 or parallel.sequence_parallel=false")
    family = None if plugin is not None else model_family(config_value(cfg, "model.name"))
    if family is None or not family.sequence_parallel:
        name = config_value(cfg, "model.name") if family else f"{plugin_target(cfg.model)} (a plugin)"
        supported = ", ".join(f.name for f in MODEL_FAMILIES.values() if f.sequence_parallel)
        raise ConfigError(f"parallel.sequence_parallel=true is not available for model={name}: it is for {supported}; "
                          f"set parallel.sequence_parallel=false")
    seq_len = int(config_value(cfg, "model.seq_len"))
    if seq_len % tp:
        raise ConfigError(f"parallel.sequence_parallel=true splits model.seq_len={seq_len} into parallel.tp={tp} "
                          f"parts: choose a sequence length divisible by {tp}")
    return True


def _check_distributed_optimizer(optim: OptimSpec, info: ScheduleInfo, fused_models: bool,
                                 compile_backend: str | None = None) -> None:
    """ZeRO updates every shard at one flush; the asynchronous schedules update per stage at their
    own times, Harmony keeps its state on the host and fused model sets have their own optimizer.
    zero3's gathers run in the layers' forward pre-hooks, which torch.compile would trace."""
    value = _zero_name(optim.zero)
    if optim.reshard_after_forward and optim.zero != 3:
        raise ConfigError(f"optim.reshard_after_forward=true applies to sharded parameters, not optim.distributed={value}: "
                          f"set optim.distributed=zero3 or optim.reshard_after_forward=false")
    if not optim.distributed:
        return
    if info.asynchronous or info.memory_virtualised:
        raise ConfigError(f"optim.distributed={value} needs a flush schedule (1f1b, gpipe, interleaved, zb_h2, zbv, "
                          f"dualpipev), not schedule={info.name}: set optim.distributed=false or pick one of those")
    if fused_models:
        raise ConfigError(f"optim.distributed={value} does not apply to train.models (fused model sets): "
                          f"set optim.distributed=false")
    if optim.impl != "torch":
        raise ConfigError(f"optim.distributed={value} needs optim.impl=torch (got {optim.impl}): set optim.impl=torch")
    if optim.zero == 3 and compile_backend is not None:
        raise ConfigError(f"optim.distributed=zero3 gathers parameters in forward hooks that train.compile would trace: "
                          f"set train.compile=false or use optim.distributed=zero2")


def _zero_name(level: int) -> str:
    return "false" if level == 0 else f"zero{level}"


def _schedule(cfg: Any) -> ScheduleInfo:
    name = config_value(cfg, "schedule.name")
    try:
        return schedule_info(name)
    except ScheduleError:
        raise ConfigError(unknown_schedule(name)) from None


def _tensor_parallel(cfg: Any) -> Any:
    """parallel.tp, checked against the model (refused with per-stage replica counts)."""
    tp = config_value(cfg, "parallel.tp") or 1
    if isinstance(tp, int) and tp > 1:
        check_tensor_parallel_config(cfg.model, tp)
        if config_value(cfg, "parallel.stage_replicas"):
            raise ConfigError(f"parallel.stage_replicas with parallel.tp = {tp} is not supported: replicate stages "
                              f"with tp=1, or use parallel.dp for equal replicas")
    return tp


def _layout(cfg: Any, info: ScheduleInfo) -> ParallelLayout:
    """The degrees, per-stage replica counts and the placement of virtual stages on ranks."""
    replicas = config_value(cfg, "parallel.stage_replicas")
    replicas = tuple(replicas) if replicas else ()
    if replicas and not info.replicated_stages:
        raise ConfigError(f"parallel.stage_replicas={list(replicas)} gives stages their own replica counts, which "
                          f"only schedule=pipedream (1F1B-RR) runs: use schedule=pipedream, or parallel.dp for "
                          f"equal replicas")
    layout = ParallelLayout(pp=cfg.parallel.pp, dp=cfg.parallel.dp, tp=cfg.parallel.tp, vpp=cfg.parallel.vpp,
                            cp=_context_parallel_degree(cfg), stage_replicas=replicas, ep=_expert_parallel_degree(cfg))
    placement = info.placement_for(layout.pp)
    if placement.kind != "round-robin":   # zbv, dualpipev: two chunks per rank in a V (vpp = 1, the default, or 2)
        if layout.vpp not in (1, 2):
            raise ConfigError(f"parallel.vpp = {layout.vpp}: schedule={info.name} holds exactly 2 chunks per rank "
                              f"(a V); set parallel.vpp=2 or leave it at 1")
        return ParallelLayout(pp=layout.pp, dp=layout.dp, tp=layout.tp, vpp=placement.vpp, cp=layout.cp,
                              placement=placement.kind, ep=layout.ep)
    if layout.vpp > 1 and not info.interleaves:
        raise ConfigError(f"parallel.vpp = {layout.vpp} needs schedule=interleaved, zbv or dualpipev "
                          f"(got schedule={info.name})")
    return layout


def _context_parallel_degree(cfg: Any) -> Any:
    """parallel.cp (1 where an older config has no such key)."""
    cp = config_value(cfg, "parallel.cp")
    return 1 if cp is None else cp


def _expert_parallel_degree(cfg: Any) -> Any:
    """parallel.ep (1 where an older config has no such key), checked against the model first."""
    ep = config_value(cfg, "parallel.ep")
    ep = 1 if ep is None else ep
    if isinstance(ep, int) and not isinstance(ep, bool) and ep > 1:
        replicas = cfg.parallel.dp * _context_parallel_degree(cfg)
        check_expert_parallel_config(cfg.model, ep, replicas if isinstance(replicas, int) else None)
    return ep


def _check_expert_parallel(cfg: Any, layout: ParallelLayout, info: ScheduleInfo, optim: OptimSpec) -> None:
    """What experts split over parallel.ep ranks need beyond the model (``_expert_parallel_degree``):
    a flush schedule on a grid, and at most zero1 (whose shards keep the experts out)."""
    ep = layout.ep
    if ep == 1:
        return
    if info.asynchronous or info.memory_virtualised:
        raise ConfigError(f"schedule={info.name} with parallel.ep={ep} is not supported: use a flush schedule "
                          f"(gpipe, 1f1b, interleaved, zbv, dualpipev) or parallel.ep=1")
    if optim.zero >= 2:
        raise ConfigError(f"optim.distributed=zero{optim.zero} with parallel.ep={ep} is not supported (its shards "
                          f"span dp x cp, whose ranks hold different experts): use optim.distributed=zero1 (experts "
                          f"kept whole) or false, or parallel.ep=1")
    if optim.zero == 1 and config_value(cfg, "precision.name") == "fp16":   # the scaler unscales the shards only
        raise ConfigError(f"precision=fp16 with optim.distributed=zero1 and parallel.ep={ep} is not supported: use "
                          f"precision=bf16, optim.distributed=false or parallel.ep=1")
    if config_value(cfg, "train.models"):
        raise ConfigError(f"train.models (a fused model set) with parallel.ep={ep} is not supported: set "
                          f"parallel.ep=1")


def _check_context_parallel(cfg: Any, layout: ParallelLayout, info: ScheduleInfo, seq_len: int | None) -> None:
    """What a sequence split over parallel.cp ranks needs: a family with ring attention, no attention
    dropout, 2·cp equal chunks of every sequence, and a runtime that reduces over dp x cp."""
    cp = layout.cp
    if cp == 1:
        return
    check_context_parallel_config(cfg.model, cp)
    dropout = config_value(cfg, "model.dropout") or 0.0
    if dropout > 0:
        raise ConfigError(f"model.dropout={dropout} with parallel.cp={cp}: ring attention has no dropout; "
                          f"set model.dropout=0 or parallel.cp=1")
    if seq_len is not None and seq_len % (2 * cp):
        raise ConfigError(f"model.seq_len={seq_len} is not divisible by 2·parallel.cp = {2 * cp} (every sequence is "
                          f"cut into 2·cp equal chunks): use a multiple of {2 * cp} or a smaller parallel.cp")
    if info.memory_virtualised:
        raise ConfigError(f"schedule={info.name} with parallel.cp={cp} is not supported (Harmony runs whole "
                          f"sequences per device): set parallel.cp=1")
    if config_value(cfg, "train.models"):
        raise ConfigError(f"train.models (a fused model set) with parallel.cp={cp} is not supported: set "
                          f"parallel.cp=1")


def _vertical_sync(cfg: Any, info: ScheduleInfo) -> bool:
    vertical_sync = Section(cfg, "schedule").flag("vertical_sync")
    if vertical_sync and not info.replicated_stages:
        raise ConfigError(f"schedule.vertical_sync=true applies to schedule=pipedream only (got "
                          f"schedule={info.name}): set schedule.vertical_sync=false or use schedule=pipedream")
    return vertical_sync


def _check_tied_embedding(cfg: Any, info: ScheduleInfo, layout: ParallelLayout) -> None:
    if info.asynchronous and layout.pp > 1 and config_value(cfg, "model.tie_embeddings"):
        raise ConfigError(f"schedule={info.name} cannot tie the embedding (stage 0) to the head "
                          f"(stage {layout.pp - 1}): stages update at different times, so their copies would diverge; "
                          f"set model.tie_embeddings=false")


def _microbatches(cfg: Any, layout: ParallelLayout) -> int:
    """Micro-batches per pipeline per iteration: the global batch over dp micro-batches."""
    global_batch, micro = cfg.train.global_batch_size, cfg.train.micro_batch_size
    if global_batch % (layout.dp * micro):
        raise ConfigError(f"train.global_batch_size={global_batch} is not divisible by parallel.dp*train.micro_batch_size "
                          f"= {layout.dp}*{micro} = {layout.dp * micro}: use a multiple of {layout.dp * micro}")
    return global_batch // (layout.dp * micro)


def _bounds(cfg: Any, num_layers: int, layout: ParallelLayout, plugin: CheckedModel | None) -> list:
    """[start, end) layers per virtual stage: parallel.layers_per_stage, or a split by estimated cost."""
    counted = plugin.layer_counts if plugin is not None else None
    return split_layers(num_layers, layout.num_virtual_stages, config_value(cfg, "parallel.layers_per_stage"),
                        _layer_costs(cfg, num_layers, layout.num_virtual_stages, counted))


def _harmony(cfg: Any, info: ScheduleInfo, layout: ParallelLayout, num_layers: int,
             microbatches: int) -> HarmonySpec | None:
    """Harmony's packs and groups for schedule=harmony_pp (None otherwise), after checking that the
    schedule can be built for these stages and micro-batches."""
    try:
        if layout.stage_replicas:
            pipedream_replicated(layout.stage_replicas, microbatches)
        elif info.memory_virtualised:
            return harmony_spec(cfg, layout, num_layers, microbatches, str(config_value(cfg, "precision.name")), info)
        else:
            build_schedule(info.name, layout.pp, microbatches, layout.vpp)
    except ScheduleError as error:
        raise ConfigError(f"{error} (microbatches = global_batch_size / (dp * micro_batch_size))") from None
    return None


def _multi_model(cfg: Any, info: ScheduleInfo, layout: ParallelLayout, optim: OptimSpec,
                 train: TrainSpec) -> MultiModelSpec | None:
    """train.models as a fused model set (None: one model), with what it composes with checked and
    every layer run fused once on the meta device (torch)."""
    multi_model = check_multi_model(cfg, info.name, info.asynchronous, layout.tp, optim.impl)
    _check_compile(train.compile, info, layout.tp, multi_model is not None)
    _check_distributed_optimizer(optim, info, multi_model is not None, train.compile)
    if multi_model is not None:
        from pipedream.multi_model.fused import build_fused_model   # torch, only for a fused set
        build_fused_model(cfg.model, multi_model)
    return multi_model


def build_run_spec(cfg: Any, world_size: int | None = None, plugin: CheckedModel | None = None) -> RunSpec:
    """Validates ``cfg`` into the run's spec, section by section; with ``world_size`` also checks it
    against pp*tp*cp*dp. ``plugin``: the model plugin as ``models.checked_plugin`` read it (read here
    when not given)."""
    if plugin is None:
        plugin = checked_plugin(cfg.model)
    num_layers = _num_layers(cfg, plugin)
    seq_len = check_data_section(cfg, plugin)
    optim = OptimSpec.from_config(cfg, OPTIMIZERS)
    info = _schedule(cfg)
    granularity = _granularity(cfg)
    for key in ("train.steps", "train.global_batch_size", "train.micro_batch_size"):
        _positive(cfg, key)
    recompute = _recompute(cfg, granularity, plugin, info)
    train = TrainSpec.from_config(cfg)
    sequence_parallel = _check_sequence_parallel(cfg, _tensor_parallel(cfg), plugin)
    layout = _layout(cfg, info)
    _check_context_parallel(cfg, layout, info, seq_len)
    _check_expert_parallel(cfg, layout, info, optim)
    ep_overlap = ep_overlap_enabled(cfg, layout, info)
    vertical_sync = _vertical_sync(cfg, info)
    _check_tied_embedding(cfg, info, layout)
    microbatches = _microbatches(cfg, layout)
    bounds = _bounds(cfg, num_layers, layout, plugin)   # before any schedule is built: pp = 10**12 must not
    harmony = _harmony(cfg, info, layout, num_layers, microbatches)   # build 10**12 action lists
    precision = PrecisionSpec.from_config(cfg, info.name, info.asynchronous)
    device = str(Section(cfg, "cluster").raw("device"))
    check_apex(optim.impl, device)
    multi_model = _multi_model(cfg, info, layout, optim, train)
    if info.asynchronous and plugin is not None:
        _check_ties_in_one_stage(cfg, plugin.model.tied, layout, bounds, info.name)
    if world_size is not None:
        layout.check_world_size(world_size)
    return RunSpec(layout=layout, schedule=info, micro_batch=cfg.train.micro_batch_size, microbatches=microbatches,
                   global_batch=cfg.train.global_batch_size, num_layers=num_layers, bounds=tuple(bounds),
                   recompute=recompute, seq_len=seq_len, vertical_sync=vertical_sync,
                   scatter_gather=Section(cfg, "comm").flag("scatter_gather") and not sequence_parallel,
                   device=device, plan=Section(cfg, "parallel").optional_text("plan"), precision=precision,
                   train=train, optim=optim, loop=LoopSpec.from_config(cfg),
                   checkpoint=CheckpointSpec.from_config(cfg), trace=TraceSpec.from_config(cfg), harmony=harmony,
                   sequence_parallel=sequence_parallel, preemption=PreemptionSpec.from_config(cfg),
                   multi_model=multi_model, config=OmegaConf.to_container(cfg, resolve=True),
                   plugin_forward_flops=plugin.forward_flops_per_sample if plugin is not None else None,
                   ep_overlap=ep_overlap)
