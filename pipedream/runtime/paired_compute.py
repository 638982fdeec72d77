"""Runs a forward and a backward of another chunk at the same time (``schedules.paired``), as
DualPipe overlaps each F+B pair of its main phase: the forward, and the sends of its output, on a
worker thread; the actions between them and the backward on the calling thread. While one waits for
its expert-parallel all-to-all (the wait releases the GIL), the other computes.

Why this is exact: the two chunks hold disjoint parameters, each thread runs its action's
operations in their usual order, and the exchanges of forwards and of backwards travel on process
groups of their own (``ExpertParallel.backward_group``), each used by one thread at a time in the
action list's order, so every rank issues each group's collectives in the same order. Every other
collective (gradient sync, step) runs between pairs, on the calling thread."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator

from pipedream.schedules import Action
from pipedream.schedules.paired import Pair


class PairedCompute:
    """The worker thread of one executor (started at the first pair)."""

    def __init__(self) -> None:
        self._worker: ThreadPoolExecutor | None = None

    def run(self, pair: Pair, order: list[Action], handle: Callable[[int], None]) -> None:
        """``handle(i)`` runs the i-th action of ``order``: the pair's forward and its sends on the
        worker, the rest up to the backward here; returns when both are done."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paired-forward")
        forward_part = (pair.forward, *pair.forward_sends)
        future = self._worker.submit(lambda: [handle(i) for i in forward_part])
        try:
            for i in range(pair.forward + 1, pair.backward + 1):
                if i not in pair.forward_sends:
                    handle(i)
        finally:
            future.result()   # the forward's error, if any, surfaces here

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


@contextmanager
def running(exchanges, action: Action) -> Iterator[None]:
    """Names ``action`` to the model's exchange tally (``ExchangeTally.running``) on this thread
    while it runs, so a trace can tell whose all-to-all each one is; nothing without a tally."""
    if exchanges is None:
        yield
        return
    exchanges.running(str(action))
    try:
        yield
    finally:
        exchanges.running(None)
