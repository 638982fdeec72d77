"""A heterogeneous fleet (``conf/fleet/*.yaml``) and the jobs sharing it (a jobs file or a trace).

A fleet is a few accelerator types, each named by a ``conf/cluster`` preset (device sheet, GPUs per
server, links: what the planner needs to plan a job on it), with a GPU count and a price per
GPU-hour. A job is what Gavel's policies see (dissertation ch. 5.4): a model and batch the planner
can plan, the steps it must train, the GPUs it asks for (``scale_factor``), a fairness weight, an
optional deadline (SLO) and its arrival time.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from planner.errors import PlannerError


@dataclass(frozen=True)
class GpuType:
    name: str
    preset: str  # conf/cluster/<preset>.yaml
    count: int
    price_per_hour: float


@dataclass(frozen=True)
class Fleet:
    name: str
    types: tuple[GpuType, ...]

    @property
    def type_names(self) -> list[str]:
        return [t.name for t in self.types]

    @property
    def counts(self) -> list[int]:
        return [t.count for t in self.types]

    @property
    def prices(self) -> list[float]:
        return [t.price_per_hour for t in self.types]


def fleet_from_config(cfg: Mapping[str, Any]) -> Fleet:
    name = str(cfg.get("name", "fleet"))
    raw = cfg.get("types") or {}
    if not raw:
        raise PlannerError(f"fleet {name} has no types: list them as types: {{v100: {{preset: v100_16gb_x8, "
                           f"count: 36, price_per_hour: 2.48}}, ...}} (conf/fleet/)")
    types = []
    for type_name, spec in raw.items():
        count, price = spec.get("count"), spec.get("price_per_hour", 0.0)
        if not isinstance(count, int) or count < 1:
            raise PlannerError(f"fleet.types.{type_name}.count = {count!r} must be a positive integer (GPUs of that type)")
        if not isinstance(price, (int, float)) or price < 0:
            raise PlannerError(f"fleet.types.{type_name}.price_per_hour = {price!r} must be a number >= 0 (dollars per GPU-hour)")
        if not spec.get("preset"):
            raise PlannerError(f"fleet.types.{type_name} names no preset: set preset to a conf/cluster file "
                               f"(e.g. v100_16gb_x8) that describes one server of that type")
        types.append(GpuType(str(type_name), str(spec["preset"]), count, float(price)))
    return Fleet(name, tuple(types))


@dataclass(frozen=True)
class Job:
    """One training job. ``throughput`` (type -> steps/s) replaces the planner's prediction for the
    types it names: measured numbers for real jobs (docs/cluster.md, Feeding real jobs)."""

    name: str
    model: str
    batch: int
    steps: float
    scale_factor: int = 1
    weight: float = 1.0
    slo_hours: float | None = None
    entity: str | None = None  # hierarchical policies: the team it belongs to (None: an entity of its own)
    entity_weight: float | None = None  # that entity's weight, from the jobs file's entities: table
    arrival_hours: float = 0.0
    profile: str | None = None
    overrides: tuple[str, ...] = ()
    throughput: Mapping[str, float] = field(default_factory=dict)

    @property
    def kind(self) -> tuple:
        """What decides its throughput: jobs of one kind share a row of the planner's T."""
        return (self.model, self.batch, self.scale_factor, self.profile, self.overrides)


JOB_KEYS = {"name", "model", "batch", "steps", "scale_factor", "weight", "slo_hours", "arrival_hours",
            "profile", "overrides", "throughput", "entity"}


def job_from_mapping(raw: Mapping[str, Any], index: int, entities: Mapping[str, float] | None = None) -> Job:
    where = f"jobs[{index}]"
    unknown = set(raw) - JOB_KEYS
    if unknown:
        raise PlannerError(f"{where} has unknown keys {sorted(unknown)}: a job has {sorted(JOB_KEYS)}")
    for key in ("model", "batch", "steps"):
        if raw.get(key) is None:
            raise PlannerError(f"{where} has no {key}: every job needs model (a conf/model preset), batch and steps")
    batch, steps, scale = raw["batch"], raw["steps"], raw.get("scale_factor", 1)
    if not isinstance(batch, int) or batch < 1:
        raise PlannerError(f"{where}.batch = {batch!r} must be a positive integer (samples per step)")
    if not isinstance(steps, (int, float)) or steps <= 0:
        raise PlannerError(f"{where}.steps = {steps!r} must be a positive number (training steps)")
    if not isinstance(scale, int) or scale < 1:
        raise PlannerError(f"{where}.scale_factor = {scale!r} must be a positive integer (GPUs the job runs on)")
    weight = raw.get("weight", 1.0)
    if not isinstance(weight, (int, float)) or weight <= 0:
        raise PlannerError(f"{where}.weight = {weight!r} must be a number > 0 (its share in fairness policies)")
    slo = raw.get("slo_hours")
    if slo is not None and (not isinstance(slo, (int, float)) or slo <= 0):
        raise PlannerError(f"{where}.slo_hours = {slo!r} must be a number of hours > 0 or null")
    entity = raw.get("entity")
    if entity is not None and str(entity) not in (entities or {}):
        raise PlannerError(f"{where}.entity = {entity!r} has no weight: add it to the jobs file's entities: table "
                           f"(e.g. entities: {{{entity}: 1}})")
    return Job(name=str(raw.get("name", f"job{index}")), model=str(raw["model"]), batch=batch, steps=float(steps),
               scale_factor=scale, weight=float(weight), slo_hours=None if slo is None else float(slo),
               arrival_hours=float(raw.get("arrival_hours", 0.0)), profile=raw.get("profile"),
               entity=None if entity is None else str(entity),
               entity_weight=None if entity is None else entities[str(entity)],
               overrides=tuple(str(o) for o in raw.get("overrides") or ()),
               throughput={str(k): float(v) for k, v in (raw.get("throughput") or {}).items()})


def load_jobs(path: str) -> list[Job]:
    """A YAML or JSON file: a list of jobs, or a mapping with a ``jobs`` list (and an ``entities:``
    table of weights for the hierarchical policies)."""
    file = Path(path)
    if not file.is_file():
        raise PlannerError(f"jobs={path}: no such file; write a YAML/JSON list of jobs (docs/cluster.md, Jobs file)")
    import yaml

    text = file.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as err:
        raise PlannerError(f"jobs={path} does not parse: {str(err).splitlines()[0]}") from None
    rows = data.get("jobs") if isinstance(data, dict) else data
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise PlannerError(f"jobs={path} holds no list of jobs: write a list of mappings with model, batch, steps")
    entities = entity_weights(data.get("entities") if isinstance(data, dict) else None, path)
    return [job_from_mapping(raw, i, entities) for i, raw in enumerate(rows)]


def entity_weights(table: Any, path: str) -> dict[str, float]:
    """The ``entities:`` table (entity -> weight > 0), empty when the file has none."""
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise PlannerError(f"jobs={path}: entities must map each entity to its weight, e.g. entities: {{research: 1, "
                           f"product: 2}}")
    for name, weight in table.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
            raise PlannerError(f"jobs={path}: entities.{name} = {weight!r} must be a number > 0 (the entity's share "
                               f"in the hierarchical policies)")
    return {str(name): float(weight) for name, weight in table.items()}


def entity_arrays(jobs: Sequence[Job]) -> tuple[list[int], list[float]]:
    """(each job's entity index, each entity's weight) for the hierarchical policies: the named
    entities in order of first appearance, then a job without one as an entity of its own, weighing
    its own ``weight``."""
    index: dict[str, int] = {}
    of_job, weights = [], []
    for job in jobs:
        key = job.entity if job.entity is not None else f"job {len(of_job)}"
        if key not in index:
            index[key] = len(weights)
            weights.append(job.entity_weight if job.entity is not None else job.weight)
        of_job.append(index[key])
    return of_job, weights


def jobs_to_json(jobs: Sequence[Job]) -> list[dict]:
    return [{"name": j.name, "model": j.model, "batch": j.batch, "steps": j.steps, "scale_factor": j.scale_factor,
             "weight": j.weight, "slo_hours": j.slo_hours, "arrival_hours": j.arrival_hours,
             **({"entity": j.entity, "entity_weight": j.entity_weight} if j.entity is not None else {})} for j in jobs]
