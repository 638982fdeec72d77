"""CPU core binding of a rank, torch-free: ``python -m launcher`` decides one core set per local rank
(``launcher.bind_cores``) and hands the sets to every rank in ``PIPEDREAM_CORE_SETS``; each rank pins
itself to its set at the top of its entry point (``pipedream.train``), before torch is imported and
starts its thread pools, so that every pool thread inherits the set. Without the variable (plain
``torchrun``) nothing is bound."""
from __future__ import annotations

import os
from typing import Mapping, Sequence

ENV = "PIPEDREAM_CORE_SETS"   # "0,1|2,3": local rank 0 on cores 0 and 1, local rank 1 on 2 and 3


def even_sets(cores: Sequence[int], ranks: int) -> list[tuple[int, ...]]:
    """``cores`` (in order) split into ``ranks`` disjoint sets whose sizes differ by at most one."""
    cores = sorted(cores)
    size, extra = divmod(len(cores), ranks)
    sets, start = [], 0
    for rank in range(ranks):
        end = start + size + (rank < extra)
        sets.append(tuple(cores[start:end]))
        start = end
    return sets


def format_core_sets(sets: Sequence[Sequence[int]]) -> str:
    return "|".join(",".join(str(core) for core in cores) for cores in sets)


def parse_core_sets(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(core) for core in part.split(",")) for part in text.split("|")]


def bind_this_rank(environ: Mapping[str, str] = os.environ) -> tuple[int, ...] | None:
    """Pins this process to its local rank's core set; the set, or None where nothing is bound."""
    text = environ.get(ENV)
    if not text:
        return None
    sets = parse_core_sets(text)
    cores = sets[int(environ.get("LOCAL_RANK", "0")) % len(sets)]
    os.sched_setaffinity(0, cores)
    return cores
