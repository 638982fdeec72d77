"""The one interface the trainer and the checkpoints drive a rank through.

``PipelineEngine`` (fixed stages) and ``HarmonyEngine`` (layer packs swapped through the devices:
``ScheduleInfo.memory_virtualised``) both implement it, so the training loop never asks which
engine it holds. A member only one engine needs has the natural answer in the other (no fused
set: no per-model losses; no host tier: no memory report).
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from models.tensor_parallel import TensorParallel
from pipedream.config.layout import Coords
from pipedream.config.run_spec import RunSpec
from pipedream.numerics.loss_scaler import LossScaler
from pipedream.runtime.runner import StepResult
from pipedream.runtime.stage import StashStats


@runtime_checkable
class Engine(Protocol):
    spec: RunSpec
    coords: Coords                      # this rank's (pipeline, data, tensor) position
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    tp: TensorParallel | None           # this rank's tensor-parallel slice, for checkpoint shards

    @property
    def weight_versions(self) -> int:
        """Peak weight versions this rank has held (1 unless ``ScheduleInfo.asynchronous``)."""

    @property
    def loss_scaler(self) -> LossScaler | None:
        """fp16's loss scaler (None for the other precisions)."""

    @property
    def stash_stats(self) -> StashStats:
        """Peak in-flight micro-batches and the bytes their stashes held."""

    def train_step(self, batches: dict[int, Any], grad_norm: bool = True) -> StepResult:
        """One iteration over this rank's micro-batches; the global mean loss."""

    def evaluate(self, batches: dict[int, Any]) -> float:
        """The global mean loss of ``batches`` (no update)."""

    def model_val_losses(self) -> list[float]:
        """Collective for a fused model set: each model's mean validation loss since the last call;
        empty for one model."""

    def drain(self) -> StepResult | None:
        """Finishes every admitted micro-batch (before a checkpoint, or at the end)."""

    def resume_at(self, step: int) -> None:
        """A run restored from a checkpoint continues at ``step``."""

    def global_layers(self) -> dict[int, nn.Module]:
        """The layers a checkpoint saves, by their index in the whole model."""

    def model_statistics(self) -> dict[str, Any]:
        """Collective at logged steps: the model's layer statistics since the last call, summed over
        ranks (metrics.jsonl fields), or empty."""

    def comm_bytes(self) -> tuple[int, int]:
        """Bytes this rank has sent and received between stages so far."""

    def all_to_all(self) -> dict[str, float]:
        """Expert parallelism's token exchanges on this rank so far (summary.json's comm fields), or empty."""

    def memory_report(self) -> dict[str, Any] | None:
        """summary.json's per-rank memory record (a memory-virtualised run's device budget and swaps),
        or None."""

    def fusion_report(self) -> dict[str, Any] | None:
        """A fused model set: this rank's fusion timings and feature-map memory, or None."""
