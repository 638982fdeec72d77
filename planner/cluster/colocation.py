"""Space sharing (dissertation ch. 5.3.1): which job pairs may share a GPU, and how fast each member
runs when they do.

Two sources, the first winning for a pair it names:

* the jobs file's ``colocated:`` table, measured throughputs of named pairs per type:
  ``{jobs: [a, b], throughput: {v100: [steps/s of a, steps/s of b], ...}}`` (a type it leaves out:
  the pair does not share a GPU there);
* ``colocation_factor`` (an estimate, for traces without measurements): any two single-GPU jobs may
  share a GPU of a type where both their plans fit its memory together (the planner's device memory
  of each, less the reserve, against what the GPU leaves usable), each keeping that fraction of its
  own throughput on the type. The fraction itself is an assumption (docs/cluster.md, Space sharing):
  the planner's cost model keeps a lone job's device busy all step, so it cannot say how much of
  a GPU a second job would find idle.

The planner predicts a job alone on a device, not a co-located pair, so without one of the two
there is no space sharing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from planner.cluster.fleet import Fleet, Job
from planner.errors import PlannerError


@dataclass(frozen=True)
class Colocation:
    """``pairs`` (P, 2): indices into the trace's jobs; ``pair_T`` (P, types, 2): each member's steps/s
    when paired; ``factor``: the estimate for single-GPU pairs the table does not name (None: none)."""

    pairs: np.ndarray
    pair_T: np.ndarray
    factor: float | None
    T: np.ndarray
    scale: np.ndarray
    memory: np.ndarray | None = None  # (jobs, types) bytes each job's plan needs (the estimate's check)
    usable: np.ndarray | None = None  # (types,) bytes a GPU of each type leaves usable

    def fits_together(self, a: int, b: int) -> np.ndarray:
        """(types,) whether jobs a and b fit one GPU's memory together (all types without memory figures)."""
        if self.memory is None or self.usable is None:
            return np.ones(len(self.T[a]), dtype=bool)
        return self.memory[a] + self.memory[b] <= self.usable

    def among(self, rows: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The pairs both of whose members are in ``rows``, indexed into ``rows``, and their rates."""
        where = {int(r): i for i, r in enumerate(rows)}
        pairs, rates, named = [], [], set()
        for (a, b), rate in zip(self.pairs, self.pair_T):
            named.add((int(a), int(b)))
            if int(a) in where and int(b) in where:
                pairs.append((where[int(a)], where[int(b)]))
                rates.append(rate)
        if self.factor is not None:
            single = [int(r) for r in rows if self.scale[int(r)] == 1]
            for i, a in enumerate(single):
                for b in single[i + 1:]:
                    fits = self.fits_together(a, b)
                    if (a, b) not in named and (b, a) not in named and fits.any():
                        pairs.append((where[a], where[b]))
                        rates.append(self.factor * np.stack([self.T[a], self.T[b]], axis=1) * fits[:, None])
        if not pairs:
            return None, None
        return np.array(pairs, dtype=int), np.array(rates, dtype=float)


def colocation_from(table: Sequence[Mapping[str, Any]], factor: float | None, jobs: Sequence[Job], T: np.ndarray,
                    fleet: Fleet, memory: tuple[np.ndarray, np.ndarray] | None = None) -> Colocation:
    """Check the ``colocated:`` rows against the jobs and the fleet; one line per mistake. ``memory``:
    (each job's bytes per type, each type's usable bytes) for the estimate's memory check."""
    if factor is not None and not (isinstance(factor, (int, float)) and 0 < factor <= 1):
        raise PlannerError(f"colocation_factor = {factor!r} must be in (0, 1] (each member's share of its own "
                           f"throughput when paired) or null")
    index = {j.name: i for i, j in enumerate(jobs)}
    types = fleet.type_names
    pairs, rates = [], []
    for i, row in enumerate(table):
        where = f"colocated[{i}]"
        names = row.get("jobs") if isinstance(row, Mapping) else None
        if not isinstance(names, (list, tuple)) or len(names) != 2 or names[0] == names[1]:
            raise PlannerError(f"{where}.jobs = {names!r} must name two different jobs, e.g. jobs: [resnet-a, vgg-a]")
        unknown = [n for n in names if n not in index]
        if unknown:
            raise PlannerError(f"{where} names jobs {unknown} that the jobs file does not have")
        a, b = index[names[0]], index[names[1]]
        if jobs[a].scale_factor != jobs[b].scale_factor:
            raise PlannerError(f"{where}: {names[0]} asks for {jobs[a].scale_factor} GPUs and {names[1]} for "
                               f"{jobs[b].scale_factor}: a pair shares the same GPUs, so both must ask for as many")
        rate = np.zeros((len(types), 2))
        for type_name, values in (row.get("throughput") or {}).items():
            if type_name not in types:
                raise PlannerError(f"{where}.throughput names type {type_name!r}; the fleet {fleet.name} has "
                                   f"{', '.join(types)}")
            if (not isinstance(values, (list, tuple)) or len(values) != 2
                    or not all(isinstance(v, (int, float)) and v >= 0 for v in values)):
                raise PlannerError(f"{where}.throughput.{type_name} = {values!r} must be two numbers >= 0: "
                                   f"steps/s of {names[0]} and of {names[1]} while they share a GPU")
            rate[types.index(type_name)] = values
        pairs.append((a, b))
        rates.append(rate)
    return Colocation(np.array(pairs, dtype=int).reshape(-1, 2), np.array(rates, dtype=float).reshape(-1, len(types), 2),
                      None if factor is None else float(factor), T, np.array([j.scale_factor for j in jobs]),
                      *(memory if memory is not None else (None, None)))


def read_jobs_file_colocation(path: str) -> tuple[bool, list]:
    """(space_sharing, colocated rows) from a jobs file written as a mapping; (False, []) for a list."""
    import json
    from pathlib import Path

    import yaml

    text = Path(path).read_text(encoding="utf-8")
    data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    if not isinstance(data, dict):
        return False, []
    rows = data.get("colocated") or []
    if not isinstance(rows, list):
        raise PlannerError(f"jobs={path}: colocated must be a list of {{jobs: [a, b], throughput: {{type: [x, y]}}}}")
    return bool(data.get("space_sharing", False)), rows
