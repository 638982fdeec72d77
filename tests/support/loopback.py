"""In-process stand-ins for the transport and the clock, so that several pipeline ranks' executors
run in one process: one thread per rank, messages handed over through per-channel queues.

``LoopbackComm`` offers exactly what ``Executor`` calls on ``PipeComm`` (post, wait and send of
activations and gradients, ``wait_sends``). It routes with the same ``ParallelLayout`` as the real
one but matches messages by (receiving rank, direction, micro-batch, receiving virtual stage), not
by ``PipeComm``'s tags, so it does not share the code it stands in for. A receive that was never
posted is an error, as in ``PipeComm``; a receive that never arrives times out instead of hanging.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import torch

from pipedream.config.layout import ParallelLayout

T = TypeVar("T")
MessageKey = tuple[int, bool, int, int]   # (receiving rank, is_grad, micro-batch, receiving virtual stage)


class FakeClock:
    """A clock that moves only when told to, so recorded spans are exact."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass(frozen=True)
class Message:
    src: int
    key: MessageKey
    shape: torch.Size


class LoopbackNetwork:
    """The queues every rank's ``LoopbackComm`` shares; ``sent`` logs every message in send order."""

    def __init__(self, layout: ParallelLayout, timeout: float = 10.0):
        self.layout = layout
        self.timeout = timeout
        self.sent: list[Message] = []
        self._lock = threading.Lock()
        self._mailboxes: dict[MessageKey, queue.Queue] = {}

    def mailbox(self, key: MessageKey) -> queue.Queue:
        with self._lock:
            return self._mailboxes.setdefault(key, queue.Queue())

    def deliver(self, src: int, key: MessageKey, tensor: torch.Tensor) -> None:
        # a copy, as a real transfer lands in the receiver's own buffer
        with self._lock:
            self.sent.append(Message(src, key, tensor.shape))
        self.mailbox(key).put(tensor.detach().clone())

    def undelivered(self) -> list[MessageKey]:
        with self._lock:
            return sorted(key for key, box in self._mailboxes.items() if not box.empty())

    def comm(self, rank: int, clock: FakeClock | None = None, latency: float = 0.0) -> "LoopbackComm":
        return LoopbackComm(self, rank, clock, latency)


@dataclass
class LoopbackComm:
    """One rank's end. With a ``clock``, every wait advances it by ``latency`` (a fixed transfer
    time), so the executor's measured waits are known exactly."""

    network: LoopbackNetwork
    rank: int
    clock: FakeClock | None = None
    latency: float = 0.0
    sends_waited: int = 0
    _posted: set[tuple[bool, int, int]] = field(default_factory=set)

    def _virtual_stage(self, chunk: int) -> int:
        layout = self.network.layout
        return layout.virtual_stage(layout.coords(self.rank).pp, chunk)

    def send_activation(self, microbatch: int, chunk: int, tensor: torch.Tensor) -> None:
        dst = self.network.layout.peer_rank(self.rank, microbatch, chunk, forward=True)
        self.network.deliver(self.rank, (dst, False, microbatch, self._virtual_stage(chunk) + 1), tensor)

    def send_gradient(self, microbatch: int, chunk: int, tensor: torch.Tensor) -> None:
        dst = self.network.layout.peer_rank(self.rank, microbatch, chunk, forward=False)
        self.network.deliver(self.rank, (dst, True, microbatch, self._virtual_stage(chunk) - 1), tensor)

    def post_recv_activation(self, microbatch: int, chunk: int) -> None:
        self._posted.add((False, microbatch, chunk))

    def post_recv_gradient(self, microbatch: int, chunk: int) -> None:
        self._posted.add((True, microbatch, chunk))

    def wait_activation(self, microbatch: int, chunk: int) -> torch.Tensor:
        return self._wait(False, microbatch, chunk)

    def wait_gradient(self, microbatch: int, chunk: int) -> torch.Tensor:
        return self._wait(True, microbatch, chunk)

    def wait_sends(self) -> None:
        self.sends_waited += 1   # delivery is immediate: nothing is outstanding

    def _wait(self, is_grad: bool, microbatch: int, chunk: int) -> torch.Tensor:
        if (is_grad, microbatch, chunk) not in self._posted:
            raise RuntimeError(f"receive {(is_grad, microbatch, chunk)} was never posted")
        self._posted.discard((is_grad, microbatch, chunk))
        key = (self.rank, is_grad, microbatch, self._virtual_stage(chunk))
        try:
            tensor = self.network.mailbox(key).get(timeout=self.network.timeout)
        except queue.Empty:
            raise TimeoutError(f"rank {self.rank}: nothing arrived for {key} in {self.network.timeout}s") from None
        if self.clock is not None:
            self.clock.advance(self.latency)
        return tensor


def run_ranks(fn: Callable[[int], T], world_size: int, timeout: float = 60.0) -> list[T]:
    """Runs ``fn(rank)`` for every rank, each in its own thread; returns the results by rank, or
    raises the first rank's error (a rank blocked on a failed peer then times out in its wait)."""
    results: dict[int, T] = {}
    errors: dict[int, BaseException] = {}

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as error:  # handed to the caller below
            errors[rank] = error

    threads = [threading.Thread(target=target, args=(rank,), name=f"rank{rank}", daemon=True)
               for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if errors:
        # a peer's timeout is a consequence: report the rank that failed first on its own
        causes = [r for r in sorted(errors) if not isinstance(errors[r], TimeoutError)] or sorted(errors)
        rank = causes[0]
        raise RuntimeError(f"rank {rank} failed: {errors[rank]!r}") from errors[rank]
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        raise TimeoutError(f"{stuck} still running after {timeout}s")
    return [results[rank] for rank in range(world_size)]
