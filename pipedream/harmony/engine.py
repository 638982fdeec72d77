"""One rank of a harmony_pp run: the engine the trainer drives (``engine_protocol.Engine``, as
``PipelineEngine``), built from the Harmony configuration instead of fixed stages.

A rank builds only the layers of the tasks bound to it (from the per-layer seeds, so they start
from the single-process weights), publishes the initial weights of the layers it owns to the
shared host tier (``harmony_state``), and runs its action list with ``harmony_runner``.
"""
from __future__ import annotations

import shutil
import tempfile
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from models.spec import LayerModel

from models.boundary import dtypes, to_device
from pipedream.errors import ConfigError
from pipedream.runtime.groups import build_p2p_groups
from pipedream.harmony.runner import HarmonyExecutor, HarmonyRunner
from pipedream.harmony.state import PackState, Replicas
from pipedream.offload import DeviceTier, HostTier
from pipedream.numerics.optim import build_optimizer, build_scheduler
from pipedream.numerics.precision import MixedPrecision
from pipedream.config.run_spec import RunSpec
from pipedream.runtime.runner import StepResult
from pipedream.schedules.actions import Action, Kind
from pipedream.schedules.harmony import BACKWARD, FORWARD, JIT, harmony_pp
from pipedream.runtime.shapes import BoundaryShapes
from pipedream.config.specs import OptimSpec, TrainSpec
from pipedream.runtime.stage import StashStats

def draws_dropout(modules) -> bool:
    """Whether any layer draws random masks in training (``nn.Dropout`` or an attention core's
    dropout probability)."""
    return any((isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0) or
               (isinstance(getattr(m, "dropout", None), float) and m.dropout > 0)
               for module in modules for m in module.modules())


_EVAL_KINDS = frozenset({Kind.SWAP_IN, Kind.SWAP_OUT, Kind.PREFETCH, Kind.FWD, Kind.SEND_ACT, Kind.RECV_ACT})


def shared_host_dir(rank: int) -> Path:
    """A fresh folder for the run's shared host tier (in /dev/shm where there is one), agreed by
    every rank; rank 0 removes it when its engine goes."""
    holder = [None]
    if rank == 0:
        base = "/dev/shm" if Path("/dev/shm").is_dir() else None
        holder[0] = tempfile.mkdtemp(prefix="pipedream-harmony-", dir=base)
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])


def evaluation_actions(actions: list[Action], config) -> list[Action]:
    """The forward half of a training list: forward tasks and the shared last pack's forwards,
    their weights and messages; no stashes, backwards or updates."""
    forward_roles = (FORWARD, JIT)
    return [a for a in actions if a.kind in _EVAL_KINDS and config.tasks[a.chunk].role in forward_roles
            and not (a.kind in (Kind.SWAP_IN, Kind.SWAP_OUT) and a.microbatch >= 0)]


class HarmonyEngine:
    def __init__(self, spec: RunSpec, model: LayerModel, rank: int, device: torch.device, optim: OptimSpec,
                 train: TrainSpec, timeout: timedelta, recorder=None):
        self.spec, self.model, self.rank, self.device = spec, model, rank, device
        config = spec.harmony.config
        self.config = config
        self.coords = spec.layout.coords(rank)
        count = spec.harmony.replicas
        # harmony_dp: this rank runs the one-device list (device 0 of the config) on its micro-batches
        # and owns (updates) the layers l with l mod replicas == its index
        replicas = Replicas(count, rank) if count > 1 else None
        device_index = 0 if replicas else rank
        mine = [t for t in config.tasks if t.device == device_index]
        layers = sorted({layer for t in mine for layer in range(*t.layers)})
        owned = ({layer for layer in layers if layer % count == rank} if replicas else
                 {layer for t in mine if t.role in (JIT, BACKWARD) for layer in range(*t.layers)})
        # untied, one module each: a tied member swaps in its group's first member's host weights (PackState)
        modules = {i: model.build_layer(i) for i in layers}   # on the host: parameters reach the device by swaps
        for i, module in modules.items():
            if any(True for _ in module.buffers()):
                raise ConfigError(f"layer {i} of {model.name} has buffers (e.g. BatchNorm statistics), which "
                                  f"schedule={spec.schedule.name} does not keep on the host tier: use a model without them")
        precision = MixedPrecision(spec.precision.name, device.type)
        precision.apply(list(modules.values()))   # bf16: each layer's output leaves in bf16
        self.host_dir = shared_host_dir(rank)
        if rank == 0:
            weakref.finalize(self, shutil.rmtree, self.host_dir, True)
        host = HostTier(self.host_dir, pin=device.type == "cuda")   # async swaps need page-locked memory
        self.tier = DeviceTier(host, device, spec.harmony.device_budget_bytes)
        self.state = PackState(modules, owned, host, self.tier, dist.barrier, replicas, model.tied)
        # a rank that owns no layer still keeps the learning-rate schedule (an empty placeholder)
        params = list(self.state.host_params.values()) or [nn.Parameter(torch.zeros(0))]
        self.optimizer = build_optimizer(optim, params, float(train.lr))
        self.scheduler = build_scheduler(self.optimizer, train)
        input_dtype = dtypes(model.make_batch(1, torch.Generator().manual_seed(0))[0])
        layer_shapes = BoundaryShapes(model, [(i, i + 1) for i in range(model.num_layers)], input_dtype)
        schedules = harmony_pp(config)
        self.actions = schedules[device_index]
        self.eval_actions = evaluation_actions(self.actions, config)
        # one group per direction, as the other schedules (stream_model: one group would deadlock on NCCL);
        # harmony_dp sends nothing between devices
        executor = HarmonyExecutor(config, device_index, self.state, model.loss_fn, layer_shapes,
                                   None if replicas else build_p2p_groups(spec.layout), recorder,
                                   getattr(recorder, "clock", time.perf_counter), precision,
                                   spec.harmony.delay_updates or self.state.collective,
                                   (f"r{rank}",) if replicas else (),
                                   (int(train.seed), rank * spec.microbatches if replicas else 0)
                                   if draws_dropout(modules.values()) else None)
        executor.connect(schedules)
        # every replica's loss is scaled by one over the micro-batches of all of them: their sum is the mean
        self.runner = HarmonyRunner(executor, self.actions, self.optimizer, self.scheduler, spec.microbatches * count,
                                    self._global_sums, float(train.grad_clip))
        self.layer_modules = list(modules.values())
        self._owned_modules = self.state.owned_modules()
        self.tp = None   # harmony_pp does not split layers over tensor-parallel ranks
        self._stash_stats = StashStats()   # empty: the device tier counts the stashes (memory_report)

    def _global_sums(self, *values: float) -> list[float]:
        totals = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        return totals.tolist()

    @property
    def weight_versions(self) -> int:
        return 1

    @property
    def last_losses(self) -> dict[int, float]:
        return {}

    @property
    def loss_scaler(self) -> None:
        """fp32 or bf16 only (fp16 is refused): no loss scale."""
        return None

    @property
    def stash_stats(self) -> StashStats:
        return self._stash_stats

    def _on_device(self, batches: dict[int, Any]) -> dict[int, Any]:
        if self.device.type == "cpu":
            return batches
        return {k: (to_device(x, self.device), to_device(y, self.device)) for k, (x, y) in batches.items()}

    def train_step(self, batches: dict[int, Any], grad_norm: bool = True) -> StepResult:
        for module in self.layer_modules:
            module.train()
        return self.runner.run_step(self._on_device(batches), grad_norm)

    def evaluate(self, batches: dict[int, Any]) -> float:
        for module in self.layer_modules:
            module.eval()
        return self.runner.evaluate(self.eval_actions, self._on_device(batches))

    def model_val_losses(self) -> list[float]:
        return []   # fused model sets do not run under harmony_pp

    def drain(self) -> None:
        return None

    def resume_at(self, step: int) -> None:
        dist.barrier()   # every owner has loaded its layers into the shared host tier before anyone swaps one in
        self.runner.resume_at(step)

    def global_layers(self) -> dict[int, nn.Module]:
        """What a checkpoint saves of this rank: the layers it owns, over the host master weights
        that its optimizer steps (so the optimizer state is saved by the same names)."""
        return self._owned_modules

    def comm_bytes(self) -> tuple[int, int]:
        return 0, 0   # the executor's messages are not counted

    def all_to_all(self) -> dict[str, float]:
        return {}   # no expert parallelism (refused with Harmony)

    def fusion_report(self) -> None:
        return None

    def model_statistics(self) -> dict[str, Any]:
        return {}   # its layers are built one by one (no LayerModel.statistics): llama, the MoE family, has buffers

    def memory_report(self) -> dict[str, Any]:
        """summary.json's per-rank record: the budget, the peak of managed resident bytes, and the
        bytes moved per tensor class and direction in the last training step and in the run."""
        return {"device_budget_bytes": self.tier.budget_bytes,
                "peak_resident_bytes": self.tier.peak_resident_bytes,
                "swap_bytes_last_step": self.runner.last_step_swaps.as_dict(),
                "swap_bytes_total": self.tier.counters.as_dict()}

    def host_parameters(self) -> dict[str, torch.Tensor]:
        """``{"<layer>.<name>": tensor}`` of the layers this rank owns, as the host tier holds them."""
        return self.state.parameters_by_name()
