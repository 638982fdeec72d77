"""One rank's share of a pipeline: builds its stage, optimizer, gradient sync and communication
from a RunSpec, picks the runner of the schedule once (``runner_class``: flush or
asynchronous), and runs training steps and evaluation through it (``engine_protocol.Engine``)."""
from __future__ import annotations

import time
from contextlib import nullcontext
from datetime import timedelta
from functools import partial
from itertools import islice
from typing import Any

import torch
from torch import nn

from models.attention import selectively_recompute
from models.spec import LayerModel, PipelineSequential

from pipedream.numerics.apex import use_apex_layer_norm
from pipedream.runtime.comm import PipeComm
from pipedream.runtime.executor import Batch, Executor
from models.grad_accumulation import fuse_grad_accumulation
from pipedream.runtime.groups import ProcessGroups, layer_owner
from pipedream.numerics.loss_scaler import LossScaler
from pipedream.multi_model.budget import prepare_fused_stage
from pipedream.multi_model.fused import FusedLayer, FusedLayerModel
from pipedream.runtime.fused_training import MultiModelRunner, PerModelGradientSync, build_multi_optimizer
from pipedream.numerics.precision import MixedPrecision
from pipedream.numerics.expert_grads import ExpertGradients, is_expert_parameter
from pipedream.numerics.expert_optim import build_sharded_with_experts
from pipedream.numerics.grad_buckets import BucketedReduction
from pipedream.numerics.optim import (GradientSync, TiedCopy, build_optimizer, build_scheduler, build_sharded_optimizer,
                                      optimizer_state_bytes)
from pipedream.numerics.held_bytes import HeldBytes
from pipedream.numerics.param_residency import LayerResidency, layer_buckets
from pipedream.numerics.sharded_optim import ShardedOptimizer
from pipedream.numerics.sharded_reduction import ShardedReduction
from pipedream.config.run_spec import RunSpec
from pipedream.runtime.async_runner import AsyncRunner
from models.boundary import dtypes
from pipedream.runtime.runner import FlushRunner, RankParts, Runner, StepResult
from pipedream.schedules import Action, ScheduleInfo
from pipedream.schedules.forward_only import forward_only
from pipedream.runtime.shapes import BoundaryShapes
from pipedream.config.specs import OptimSpec, TrainSpec
from pipedream.runtime.stage import Stage, StashStats
from models.tensor_parallel import TensorParallel

__all__ = ["PipelineEngine", "StepResult", "runner_class"]


def runner_class(schedule: ScheduleInfo) -> type[FlushRunner] | type[AsyncRunner]:
    return AsyncRunner if schedule.asynchronous else FlushRunner


class PipelineEngine:
    def __init__(self, spec: RunSpec, model: LayerModel, rank: int, device: torch.device,
                 groups: ProcessGroups, optim: OptimSpec, train: TrainSpec, timeout: timedelta, recorder=None,
                 tp: TensorParallel | None = None, shape_model: LayerModel | None = None):
        """``model`` is this rank's tensor-parallel slice when ``tp`` is given; ``shape_model`` (the
        dense description) then serves shape inference, since boundary tensors are dense. The
        builders run in this order: each reads what the ones before it set."""
        self.spec, self.model, self.rank, self.device = spec, model, rank, device
        self.tp = tp
        multi = model if isinstance(model, FusedLayerModel) else None   # a fused model set (multi_model/)
        layout = spec.layout
        self.coords = layout.coords(rank)
        self.virtual_stages = [layout.virtual_stage(self.coords.pp, c) for c in range(layout.vpp)]
        precision = MixedPrecision(spec.precision.name, device.type)
        built = self._build_layers(precision, optim, train)
        self.stage = self._build_stage(built, precision, train, fused=multi is not None)
        self.stage.statistics = getattr(model, "statistics", None)   # a fused model set has none
        exchanges = getattr(self.stage.statistics, "exchange", None)   # expert parallelism's all-to-alls
        if exchanges is not None and hasattr(recorder, "record_exchange"):
            exchanges.observe(recorder.record_exchange, recorder.clock)
        self.params = self.stage.parameters()
        self.topology = layout.replicated()
        schedule_rank = rank if layout.stage_replicas else self.coords.pp
        runner = runner_class(spec.schedule)
        replicas = layout.stage_replica_count(self.coords.pp)
        self.fully_sharded = not multi and self._fully_sharded(optim)   # zero3, reshard_after_forward
        self.optimizer = self._build_optimizer(optim, train, groups, replicas, multi)
        self.scheduler = build_scheduler(self.optimizer, train, runner.updates_per_step(spec, self.topology,
                                                                                         schedule_rank))
        self.gradients = self._build_gradient_sync(built, groups, replicas, train, recorder, runner.global_grad_norm,
                                                   multi)
        self.residency = None   # fully sharded: tied copies' gradients wait for their sum across stages
        if self.fully_sharded:
            self.residency = LayerResidency(self.optimizer, self.stage.chunks, frozenset(
                id(copy.param) for copy in self.gradients.tied), self.stage.weight_grads)
        self.held = self._observe_held_bytes()
        self.eval_actions = self._routed(forward_only(layout.pp, spec.microbatches, layout.vpp,
                                                      layout.chunk_placement)[self.coords.pp])
        input_dtype = dtypes(model.make_batch(1, torch.Generator().manual_seed(0))[0])
        self.boundaries = BoundaryShapes(shape_model or model, list(spec.bounds), input_dtype)
        self.parts = self._build_parts(train, schedule_rank, recorder)
        self.comm = self._connect(precision, groups, timeout) if layout.pp > 1 else None
        self.parts.comm = self.comm
        self._chunks_training = False
        self.runner: Runner = MultiModelRunner(self.parts, multi) if multi else runner(self.parts)
        self.fused_stage = prepare_fused_stage(self, multi.settings) if multi else None

    def _build_layers(self, precision: MixedPrecision, optim: OptimSpec, train: TrainSpec) -> dict[int, nn.Module]:
        """This rank's layers (global index -> module) on its device, in the run's precision."""
        my_layers = [i for vs in self.virtual_stages for i in range(*self.spec.bounds[vs])]
        built = self.model.build(my_layers)
        for module in built.values():
            module.to(self.device)
        precision.apply(list(built.values()))
        if optim.impl == "apex":
            for module in built.values():
                use_apex_layer_norm(module)
        return built

    def _build_stage(self, built: dict[int, nn.Module], precision: MixedPrecision, train: TrainSpec,
                     fused: bool) -> Stage:
        """One chunk per virtual stage of this rank, and the Stage that runs them."""
        spec, layout = self.spec, self.spec.layout
        chunks = [PipelineSequential(*(built[i] for i in range(*spec.bounds[vs]))) for vs in self.virtual_stages]
        if spec.recompute.selective:   # recompute.num_layers = k: the cores of each chunk's first k layers
            selectively_recompute(chunks if spec.recompute.num_layers is None
                                  else [layer for chunk in chunks for layer in islice(chunk, spec.recompute.num_layers)])
        if train.compile is not None:   # layer by layer: the schedule still runs each stage's actions
            for module in built.values():
                module.compile(backend=train.compile)
        last = layout.num_virtual_stages - 1
        stage = Stage(chunks, [vs == 0 for vs in self.virtual_stages], [vs == last for vs in self.virtual_stages],
                      precision.fp32_loss(self.model.loss_fn), recompute=spec.recompute.full,
                      autocast=precision.autocast if precision.enabled else nullcontext,
                      recompute_layers=spec.recompute.num_layers)
        # fused layers run their Linears under vmap; compiled ones leave the weight gradients to the compiler
        if train.fuse_grad_accumulation and not fused and train.compile is None:
            for chunk in chunks:
                fuse_grad_accumulation(chunk, stage.weight_grads)
        stage.split_graphs = train.split_weight_graphs
        return stage

    def _build_optimizer(self, optim: OptimSpec, train: TrainSpec, groups: ProcessGroups, replicas: int,
                         multi: FusedLayerModel | None) -> torch.optim.Optimizer:
        """One optimizer per fused model, the distributed (sharded) one, or a plain one."""
        if multi:
            return build_multi_optimizer(optim, self.params, multi.settings)
        if not optim.distributed:
            return build_optimizer(optim, self.params, float(train.lr))
        # sharded bucket by bucket where the buckets overlap the backward (zero3 always: its
        # parameters are gathered bucket by bucket, as the layers need them)
        overlap_bytes = self._overlap_bucket_bytes(train, replicas)
        bucket_bytes = overlap_bytes if optim.zero < 3 else int(train.grad_bucket_mb * 2 ** 20)
        # fully sharded (reshard_after_forward): one bucket per layer, gathered and freed on its own
        layers = layer_buckets(self.stage.chunks, self.params) if self.fully_sharded else None
        # the shard index among the ranks that average this stage's gradients (groups.dp)
        dense, experts = self._dense_and_expert_params()
        if experts:   # zero1 under expert parallelism: the experts whole (numerics/expert_optim.py)
            optimizer = build_sharded_with_experts(optim, dense, experts, float(train.lr), groups.dp, replicas,
                                                   self.spec.layout.replica(self.rank), bucket_bytes)
        else:
            optimizer = build_sharded_optimizer(optim, self.params, float(train.lr), groups.dp, replicas,
                                                self.spec.layout.replica(self.rank), bucket_bytes, buckets=layers)
        if optim.zero == 3:   # gathered by the layers' forwards; freed at the SYNC or after each layer
            optimizer.shard_parameters(self.stage.chunks)
        # the parameters' all-gather overlaps the next forward, each layer waiting for its buckets
        # (forward pre-hooks; compiled layers would trace the wait, so they get the blocking gather)
        elif overlap_bytes is not None and train.compile is None:
            optimizer.gather_before(layer for chunk in self.stage.chunks for layer in chunk)
        return optimizer

    @staticmethod
    def _fully_sharded(optim: OptimSpec) -> bool:
        return bool(optim.distributed) and optim.zero == 3 and optim.reshard_after_forward

    def _observe_held_bytes(self) -> HeldBytes:
        """Samples the bytes held where they can peak: the SYNC, each bucket's reduce-scatter, the
        update, each zero3 gather and per-layer reduce-scatter."""
        held = HeldBytes(self.params, self._held_extra)
        for part in (self.optimizer, self.gradients, self.gradients.reduction):
            if part is not None and hasattr(part, "observe"):
                part.observe = held.sample
        return held

    def _held_extra(self) -> dict[str, int]:
        optimizer = self.optimizer
        extra = optimizer.held_bytes() if isinstance(optimizer, ShardedOptimizer) else \
            {"optimizer": optimizer_state_bytes(optimizer)}
        reduction = getattr(self.gradients, "reduction", None)
        buffers = [b.buffer for b in getattr(reduction, "buckets", ()) if getattr(b, "buffer", None) is not None]
        return {**extra, "grads": extra.get("grads", 0) + sum(t.numel() * t.element_size() for t in buffers)}



    def _build_gradient_sync(self, built: dict[int, nn.Module], groups: ProcessGroups, replicas: int,
                             train: TrainSpec, recorder: Any, global_grad_norm: bool,
                             multi: FusedLayerModel | None) -> GradientSync:
        """The gradient sync across data-parallel replicas and tied copies, with its clipping norm."""
        layout = self.spec.layout
        sharded = self.optimizer if isinstance(self.optimizer, ShardedOptimizer) else None
        norm_group = groups.pp if layout.pp > 1 and global_grad_norm else None
        sync = partial(PerModelGradientSync, count=multi.settings.count) if multi else GradientSync
        tied = self._tied_copies(built, groups)
        dense, experts = self._dense_and_expert_params()
        expert_sync = ExpertGradients(experts, groups.expert_dp, replicas, groups.ep) if experts else None
        return sync(dense, groups.dp, replicas, tied, norm_group,
                    tp_group=groups.tp if layout.tp > 1 else None, sharded=sharded,
                    reduction=self._reduction(groups, replicas, train, recorder, multi is None, sharded, tied),
                    **({"experts": expert_sync} if expert_sync is not None else {}))

    def _dense_and_expert_params(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(parameters averaged over dp x cp, experts split over the expert-parallel group)."""
        experts = [p for p in self.params if is_expert_parameter(p)]
        return [p for p in self.params if not is_expert_parameter(p)], experts

    def _build_parts(self, train: TrainSpec, schedule_rank: int, recorder: Any) -> RankParts:
        """What the runner shares with the engine (its ``comm`` set once connected)."""
        spec = self.spec
        return RankParts(spec, train, self.stage, self.params, None, self.optimizer, self.scheduler, self.gradients,
                         self.topology, schedule_rank, self.coords.pp, self.device, recorder=recorder,
                         scaler=LossScaler(spec.precision.loss_scale, self.device) if spec.precision.loss_scale
                         else None)

    def _connect(self, precision: MixedPrecision, groups: ProcessGroups, timeout: timedelta) -> PipeComm:
        """The point-to-point links to the neighbouring stages (pp > 1), connected."""
        shape_of = self.parts.shapes.of
        comm = PipeComm(self.spec.layout, self.rank, self.device, timeout, groups.p2p,
                        input_spec=lambda mb, c: precision.on_wire(
                            self.boundaries.stage_input(shape_of(mb), self.virtual_stages[c])),
                        output_spec=lambda mb, c: precision.on_wire(
                            self.boundaries.stage_output(shape_of(mb), self.virtual_stages[c])),
                        tp=self.tp, scatter_gather=self.spec.scatter_gather)
        comm.connect()
        return comm

    @property
    def executor(self) -> Executor:
        """The runner's executor (``executor.step`` is the optimizer update)."""
        return self.runner.executor

    @property
    def weight_versions(self) -> int:
        """Peak weight versions this rank has held (1 for the flush schedules)."""
        return self.runner.weight_versions

    @property
    def last_losses(self) -> dict[int, float]:
        """Asynchronous schedules: micro-batch -> loss, of the last window (last stage)."""
        return self.runner.last_losses

    @property
    def loss_scaler(self) -> LossScaler | None:
        return self.parts.scaler

    @property
    def stash_stats(self) -> StashStats:
        return self.stage.stats

    def train_step(self, batches: dict[int, Batch], grad_norm: bool = True) -> StepResult:
        """One iteration over this rank's micro-batches; returns the global mean loss (for the
        asynchronous schedules: of the micro-batches that completed in this step's window).
        ``grad_norm=False`` lets a flush schedule skip the gradient norm when it does not clip
        (every rank must pass the same value)."""
        if not self._chunks_training:   # once, and again after an evaluation (a Python call per module)
            for model_chunk in self.stage.chunks:
                model_chunk.train()
            self._chunks_training = True
        result = self.runner.run_step(batches, grad_norm)
        self.held.at_rest()
        return result

    def drain(self) -> StepResult | None:
        """Finishes every admitted micro-batch (before a checkpoint, or at the end). None for flush
        schedules, which never leave work."""
        result = self.runner.drain()
        if isinstance(self.optimizer, ShardedOptimizer):   # the last update's all-gather, if in flight;
            self.optimizer.whole_parameters()                # zero3: whole until the next step's SYNC
        return result

    def resume_at(self, step: int) -> None:
        """A run restored from a checkpoint taken after ``drain`` continues at ``step``."""
        self.runner.resume_at(step)

    def evaluate(self, batches: dict[int, Batch]) -> float:
        """With an asynchronous run in flight, evaluates the newest weights of every stage (the
        in-flight micro-batches keep their own versions and resume at the next step)."""
        for model_chunk in self.stage.chunks:
            model_chunk.eval()
        self._chunks_training = False
        parked = self.comm.park() if self.comm is not None else None   # receives posted for training
        with self.parts.shapes.evaluating(batches):
            result = self.executor.run(self.eval_actions, self.parts.to_device(batches), loss_scale=1.0, train=False)
        if parked is not None:
            self.comm.unpark(parked)
        loss_sum, count = self.parts.global_sums(result.loss_sum, float(result.loss_count))
        return loss_sum / count

    def model_val_losses(self) -> list[float]:
        return self.runner.eval_losses() if isinstance(self.runner, MultiModelRunner) else []

    def global_layers(self) -> dict[int, nn.Module]:
        layers = {}
        for chunk, virtual_stage in zip(self.stage.chunks, self.virtual_stages):
            start = self.spec.bounds[virtual_stage][0]
            for offset, layer in enumerate(chunk):   # a fused layer's edge: K models, their own names
                layers[start + offset] = layer.per_model_module() if isinstance(layer, FusedLayer) else layer
        return layers

    def model_statistics(self) -> dict[str, Any]:
        """Collective (every rank at the same logged steps): what the model's layers report since the
        previous call (``LayerModel.statistics``, e.g. MoE routing counts), summed over all ranks;
        empty for a model without statistics."""
        statistics = self.stage.statistics
        if statistics is None:
            return {}
        return statistics.report(self.parts.global_sums(*statistics.sums()))

    def all_to_all(self) -> dict[str, float]:
        """Expert parallelism's token exchanges on this rank since the run began: bytes sent to other
        ranks and seconds blocked on them; empty without expert parallelism."""
        statistics = self.stage.statistics
        if self.spec.layout.ep == 1 or statistics is None or not hasattr(statistics, "exchange"):
            return {}
        return {"all_to_all_bytes": statistics.exchange.bytes_sent, "all_to_all_s": statistics.exchange.seconds}

    def comm_bytes(self) -> tuple[int, int]:
        if self.comm is None:   # pp = 1: no stage boundaries
            return 0, 0
        return self.comm.stats.bytes_sent, self.comm.stats.bytes_received

    def memory_report(self) -> dict[str, Any]:
        """summary.json's per-rank record: ``held_bytes``, the parameter, gradient and optimizer-state
        bytes held at rest (after the last update) and at peak, measured from the tensors held."""
        return {"held_bytes": self.held.report()}

    def fusion_report(self) -> dict[str, Any] | None:
        return self.fused_stage.report() if self.fused_stage is not None else None

    def _overlap_bucket_bytes(self, train: TrainSpec, replicas: int) -> int | None:
        """The bucket size where the reduction overlaps the backward (``train.overlap_grad_reduce``)."""
        if replicas == 1 or not train.overlap_grad_reduce or self.spec.schedule.asynchronous:
            return None
        return int(train.grad_bucket_mb * 2 ** 20)

    def _reduction(self, groups: ProcessGroups, replicas: int, train: TrainSpec, recorder: Any,
                   plain_layers: bool, sharded: ShardedOptimizer | None = None,
                   tied: list[TiedCopy] = ()) -> BucketedReduction | None:
        """The data-parallel gradient buckets. Overlap needs the hooks to see every accumulation:
        flush schedules only (asynchronous ones accumulate on weight versions), and not fused model
        sets (their layers run under vmap). With the distributed optimizer, its buckets' reduce-scatters
        (``ShardedReduction``; none without overlap: ``reduce_gradients`` at the sync)."""
        if replicas == 1:
            return None
        overlap = train.overlap_grad_reduce and plain_layers and not self.spec.schedule.asynchronous
        trace = dict(recorder=recorder if hasattr(recorder, "record_reduction") else None,
                     clock=getattr(recorder, "clock", time.perf_counter))
        if sharded is not None:   # fully sharded: reduce-scattered layer by layer (LayerResidency)
            if not overlap or self.fully_sharded:
                return None
            reduction = ShardedReduction(sharded, {id(copy.param) for copy in tied}, **trace)
        else:
            reduction = BucketedReduction(self._dense_and_expert_params()[0], groups.dp, replicas,
                                          int(train.grad_bucket_mb * 2 ** 20), overlap, **trace)
        if overlap:
            self.stage.weight_grads.after_accumulate = reduction.accumulated
        return reduction

    def _routed(self, actions: list[Action]) -> list[Action]:
        """With stage replicas, a rank runs only the micro-batches routed to it."""
        if not self.spec.layout.stage_replicas:
            return actions
        replicas = self.topology.replicas[self.coords.pp]
        replica = self.topology.replica_of(self.rank)
        return [a for a in actions if a.microbatch % replicas == replica]

    def _tied_copies(self, built: dict[int, nn.Module], groups: ProcessGroups) -> list[TiedCopy]:
        copies = []
        for group_spec, process_group in zip(self.model.tied, groups.tied):
            if process_group is None:
                continue
            owner_layer = group_spec[0][0]
            mine = [(layer, name) for layer, name in group_spec if layer in built]
            layer, name = mine[0]
            owner = layer_owner(self.spec.layout, list(self.spec.bounds), owner_layer) == self.coords.pp
            copies.append(TiedCopy(built[layer].get_parameter(name), process_group, owner))
        return copies
