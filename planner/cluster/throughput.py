"""The throughput matrix T (dissertation ch. 5.3.1): each job's steps per second on each accelerator
type, from the planner's best plan for the job's model and batch on ``scale_factor`` GPUs of that
type. T[m, j] = 0 where no plan fits device memory (Gavel's -inf: the job cannot run there; a
plan that only Harmony's host-memory runtime makes fit counts as not fitting).

A job on k GPUs of a type is planned on that type's ``conf/cluster`` preset cut down to k GPUs, as
consolidated as the preset's servers allow (Gavel places a job's workers on as few servers as it
can, ch. 5.5): the largest divisor of k up to the preset's GPUs per server, times servers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from planner.errors import DoesNotFitError, PlannerError
from planner.cluster.fleet import Fleet, GpuType, Job


@dataclass(frozen=True)
class TypePlan:
    """The planner's answer for one job kind on one type: steps/s (0: nothing fits), the plan, and
    the device memory it needs of what the type's GPU leaves usable (both less the memory reserve)."""

    steps_per_s: float
    summary: str
    memory_bytes: float = 0.0
    usable_bytes: float = float("inf")


def server_shape(gpus: int, per_server: int) -> tuple[int, int]:
    """(servers, GPUs per server) holding ``gpus`` GPUs on as few servers as possible."""
    per = max(d for d in range(1, min(gpus, per_server) + 1) if gpus % d == 0)
    return gpus // per, per


class ThroughputTable:
    """Plans each (job kind, type) once; ``matrix(jobs)`` is T for those jobs."""

    def __init__(self, fleet: Fleet, precision: str | None = None, extra_overrides: Sequence[str] = ()):
        self.fleet = fleet
        self.precision = precision
        self.extra_overrides = tuple(extra_overrides)
        self._plans: dict[tuple, TypePlan] = {}
        self._presets: dict[str, dict] = {}

    def _preset(self, name: str) -> dict:
        if name not in self._presets:
            from pipedream.config.loading import config_dir, config_options

            path = config_dir() / "cluster" / f"{name}.yaml"
            if not path.is_file():
                raise PlannerError(f"fleet preset {name!r} is not a conf/cluster file: choose one of "
                                   f"{', '.join(config_options('cluster'))}")
            import yaml

            self._presets[name] = yaml.safe_load(path.read_text(encoding="utf-8"))
        return self._presets[name]

    def plan(self, job: Job, gpu: GpuType) -> TypePlan:
        key = (job.kind, gpu.name)
        if key not in self._plans:
            self._plans[key] = self._plan(job, gpu)
        return self._plans[key]

    def _plan(self, job: Job, gpu: GpuType) -> TypePlan:
        from omegaconf import open_dict

        from planner.search.auto import make_plan
        from planner.config import compose, inputs_from_config

        preset = self._preset(gpu.preset)
        if job.scale_factor > gpu.count:
            return TypePlan(0.0, f"needs {job.scale_factor} GPUs, the fleet has {gpu.count} {gpu.name}")
        servers, per_server = server_shape(job.scale_factor, int(preset.get("devices_per_node", 1)))
        overrides = [f"model={job.model}", f"cluster={gpu.preset}", f"train.global_batch_size={job.batch}",
                     "planner.simulate=false", *self.extra_overrides, *job.overrides]
        if self.precision:
            overrides.append(f"planner.precision={self.precision}")
        if job.profile:
            overrides.append(f"planner.profile={job.profile}")
        cfg = compose(overrides)
        with open_dict(cfg):
            cfg.cluster.nodes, cfg.cluster.devices_per_node = servers, per_server
        try:
            outcome = make_plan(inputs_from_config(cfg), str(cfg.planner.algorithm), str(cfg.planner.semantics), False)
        except DoesNotFitError as err:
            return TypePlan(0.0, f"does not fit: {str(err)[:160]}")
        except PlannerError as err:
            raise PlannerError(f"job {job.name} ({job.model}, batch {job.batch}) on {job.scale_factor} x "
                               f"{gpu.name}: {err}") from None
        plan = outcome.plan
        if plan.planner["algorithm"] == "harmony":
            # A Harmony plan keeps the job's state in the server's host memory and PCIe, which the
            # fleet shares between jobs and does not model: for Gavel the job does not fit there.
            return TypePlan(0.0, f"does not fit in device memory (only a harmony plan: {plan.planner['reason'][:120]})")
        par = plan.parallel
        summary = (f"{plan.planner['algorithm']} pp={par.pp} tp={par.tp} dp={par.dp} b={plan.batch.micro} "
                   f"{plan.schedule}, {plan.predicted.samples_per_s:.4g} samples/s")
        reserve = float(plan.planner["memory_reserve_bytes"])
        return TypePlan(plan.predicted.samples_per_s / job.batch, summary,
                        plan.predicted.memory_bytes_per_device - reserve, plan.predicted.memory_capacity_bytes - reserve)

    @property
    def plans_made(self) -> int:
        return len(self._plans)

    def row(self, job: Job) -> np.ndarray:
        """Steps/s of ``job`` on each type; measured numbers in ``job.throughput`` win."""
        unknown = set(job.throughput) - set(self.fleet.type_names)
        if unknown:
            raise PlannerError(f"job {job.name}: throughput names types {sorted(unknown)} the fleet "
                               f"{self.fleet.name} does not have ({', '.join(self.fleet.type_names)})")
        values = [job.throughput[g.name] if g.name in job.throughput else self.plan(job, g).steps_per_s
                  for g in self.fleet.types]
        if not any(v > 0 for v in values):
            raise PlannerError(f"job {job.name} ({job.model}, batch {job.batch}, {job.scale_factor} GPUs) runs on no "
                               f"type of {self.fleet.name}: no plan fits; lower the batch or raise scale_factor")
        return np.array(values, dtype=float)

    def matrix(self, jobs: Sequence[Job]) -> np.ndarray:
        return np.stack([self.row(j) for j in jobs]) if jobs else np.zeros((0, len(self.fleet.types)))

    def memory(self, jobs: Sequence[Job]) -> tuple[np.ndarray, np.ndarray]:
        """(jobs, types) device memory each job's plan needs, and what each type leaves usable, both
        less the reserve: what space sharing checks a pair against. A measured throughput has no
        plan: its memory counts as 0 (unknown), and a type where nothing fits holds no pair anyway."""
        need = np.zeros((len(jobs), len(self.fleet.types)))
        usable = np.full(len(self.fleet.types), np.inf)
        for m, job in enumerate(jobs):
            for j, gpu in enumerate(self.fleet.types):
                if gpu.name not in job.throughput:
                    plan = self.plan(job, gpu)
                    need[m, j] = plan.memory_bytes
                    usable[j] = min(usable[j], plan.usable_bytes)
        return need, usable

    def summaries(self, job: Job) -> dict[str, Any]:
        return {g.name: ("measured" if g.name in job.throughput else self.plan(job, g).summary)
                for g in self.fleet.types}

