"""An in-process stand-in for ``PipeComm``: the executors of all pipeline ranks run in threads of
one process and hand boundary tensors to each other through queues, so the executor, the stage
and the schedules can be tested together without starting a process."""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

Key = tuple[str, int, int]   # ("act" or "grad", micro-batch, receiving virtual stage)


class LoopbackNetwork:
    """Mailboxes keyed by what the receiver asks for; virtual stage ``chunk * pp + rank``."""

    def __init__(self, pp: int, timeout_s: float = 20.0):
        self.pp = pp
        self.timeout_s = timeout_s
        self._boxes: dict[Key, queue.Queue] = {}
        self._lock = threading.Lock()

    def box(self, key: Key) -> queue.Queue:
        with self._lock:
            return self._boxes.setdefault(key, queue.Queue())

    def comm(self, rank: int) -> LoopbackComm:
        return LoopbackComm(self, rank)


class LoopbackComm:
    """The calls the executor makes on a ``PipeComm``, with the same rule that a receive is waited
    for only after it was posted; ``log`` keeps every call in order."""

    def __init__(self, network: LoopbackNetwork, rank: int):
        self.network, self.rank = network, rank
        self.posted: set[Key] = set()
        self.log: list[tuple[str, int, int]] = []

    def _stage(self, chunk: int) -> int:
        return chunk * self.network.pp + self.rank

    def send_activation(self, microbatch: int, chunk: int, tensor: torch.Tensor) -> None:
        self.log.append(("send_act", microbatch, chunk))
        self.network.box(("act", microbatch, self._stage(chunk) + 1)).put(tensor.detach().clone())

    def send_gradient(self, microbatch: int, chunk: int, tensor: torch.Tensor) -> None:
        self.log.append(("send_grad", microbatch, chunk))
        self.network.box(("grad", microbatch, self._stage(chunk) - 1)).put(tensor.detach().clone())

    def post_recv_activation(self, microbatch: int, chunk: int) -> None:
        self.log.append(("post_act", microbatch, chunk))
        self.posted.add(("act", microbatch, self._stage(chunk)))

    def post_recv_gradient(self, microbatch: int, chunk: int) -> None:
        self.log.append(("post_grad", microbatch, chunk))
        self.posted.add(("grad", microbatch, self._stage(chunk)))

    def wait_activation(self, microbatch: int, chunk: int) -> torch.Tensor:
        return self._wait(("act", microbatch, self._stage(chunk)))

    def wait_gradient(self, microbatch: int, chunk: int) -> torch.Tensor:
        return self._wait(("grad", microbatch, self._stage(chunk)))

    def _wait(self, key: Key) -> torch.Tensor:
        if key not in self.posted:
            raise AssertionError(f"rank {self.rank} waited for {key} before posting its receive")
        self.posted.discard(key)
        self.log.append(("wait_" + key[0], key[1], key[2]))
        return self.network.box(key).get(timeout=self.network.timeout_s)

    def wait_sends(self) -> None:
        """Queued sends complete at once."""


def run_ranks(work: list[Callable[[], Any]], timeout_s: float = 60.0) -> list[Any]:
    """Runs one callable per rank in its own thread; returns their results, re-raising the first
    failure (a rank stuck past ``timeout_s`` fails the test instead of hanging it)."""
    results: list[Any] = [None] * len(work)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = work[index]()
        except BaseException as error:   # reported to the test below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(work))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    if errors:
        raise errors[0]
    if any(thread.is_alive() for thread in threads):
        raise AssertionError(f"a rank did not finish within {timeout_s} s")
    return results
