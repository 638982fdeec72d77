"""Point-to-point transfer of activations and gradients between adjacent (virtual) stages.

Every send is non-blocking and every receive is posted before it is needed and waited on only by
the compute that consumes it. Messages to a higher rank travel on one process group and messages
to a lower rank on another (``groups.DirectedGroups``), so on NCCL no stream carries both
directions between two ranks; with the per-channel order the schedules guarantee, no issue order
of the executor can then deadlock (``stream_model``, tested for every schedule). Messages carry a
tag derived from (micro-batch, chunk, direction), which Gloo matches on; NCCL matches by order.
Receivers know shapes without a handshake: they come from ``BoundaryShapes`` (shape inference on
the meta device), recomputed whenever a micro-batch's input shape changes. A tuple of tensors
crossing a boundary travels as one packed message (``boundary``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from models.boundary import Boundary, Spec, TupleSpec, grad_spec, pack
from pipedream.errors import InvariantError
from pipedream.runtime.groups import DirectedGroups
from pipedream.config.layout import ParallelLayout
from models.tensor_parallel import TensorParallel, gather_chunks, scatter_chunk

TAG_SPACE = 1 << 30


def message_tag(microbatch: int, chunk: int, vpp: int, is_grad: bool) -> int:
    return ((microbatch * vpp + chunk) * 2 + int(is_grad)) % TAG_SPACE


@dataclass
class CommStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    wait_seconds: float = 0.0


@dataclass
class _Pending:
    work: object
    buffer: torch.Tensor
    gather_to: torch.Size | None = None   # scatter/gather: the full shape to all-gather into
    unpack: TupleSpec | None = None       # a packed tuple: its members


@dataclass
class PipeComm:
    """Sends and receives of one rank. ``input_spec`` / ``output_spec`` give, for a micro-batch and
    a chunk, the (shape, dtype) of that chunk's input (what arrives from the previous virtual
    stage) and output, or a ``TupleSpec`` when a tuple crosses the boundary."""

    layout: ParallelLayout
    rank: int
    device: torch.device
    timeout: timedelta
    groups: DirectedGroups
    input_spec: Callable[[int, int], Spec]
    output_spec: Callable[[int, int], Spec]
    tp: TensorParallel | None = None      # with scatter_gather: send 1/t, all-gather on arrival
    scatter_gather: bool = False
    stats: CommStats = field(default_factory=CommStats)
    _recvs: dict[tuple[bool, int, int], _Pending] = field(default_factory=dict)
    _sends: list[_Pending] = field(default_factory=list)
    _warned_indivisible: bool = False
    # (chunk, forward) -> the peer's rank (unless stage replicas route by micro-batch) and chunk:
    # fixed by the layout, found once rather than per message
    _peers: dict[tuple[int, bool], int] = field(default_factory=dict)
    _peer_chunks: dict[tuple[int, bool], int] = field(default_factory=dict)

    def _peer(self, microbatch: int, chunk: int, forward: bool) -> int:
        if self.layout.stage_replicas:
            return self.layout.peer_rank(self.rank, microbatch, chunk, forward)
        peer = self._peers.get((chunk, forward))
        if peer is None:
            peer = self._peers[(chunk, forward)] = self.layout.peer_rank(self.rank, microbatch, chunk, forward)
        return peer

    def _peer_chunk(self, chunk: int, forward: bool) -> int:
        peer_chunk = self._peer_chunks.get((chunk, forward))
        if peer_chunk is None:
            pp_rank = self.layout.coords(self.rank).pp
            step = self.layout.next_virtual_stage if forward else self.layout.prev_virtual_stage
            peer_chunk = self._peer_chunks[(chunk, forward)] = step(pp_rank, chunk)[1]
        return peer_chunk

    # activations flow forward: I send my chunk's output, receive my chunk's input
    def send_activation(self, microbatch: int, chunk: int, tensor: Boundary) -> None:
        tag = message_tag(microbatch, self._peer_chunk(chunk, True), self.layout.vpp, False)
        self._send(tensor, self._peer(microbatch, chunk, True), tag)

    def post_recv_activation(self, microbatch: int, chunk: int) -> None:
        tag = message_tag(microbatch, chunk, self.layout.vpp, False)
        self._post_recv((False, microbatch, chunk), self.input_spec(microbatch, chunk),
                        self._peer(microbatch, chunk, False), tag)

    def wait_activation(self, microbatch: int, chunk: int) -> Boundary:
        return self._wait_recv((False, microbatch, chunk))

    # gradients flow backward: I send my input's gradient, receive my output's gradient
    def send_gradient(self, microbatch: int, chunk: int, tensor: Boundary) -> None:
        tag = message_tag(microbatch, self._peer_chunk(chunk, False), self.layout.vpp, True)
        self._send(tensor, self._peer(microbatch, chunk, False), tag)

    def post_recv_gradient(self, microbatch: int, chunk: int) -> None:
        tag = message_tag(microbatch, chunk, self.layout.vpp, True)
        self._post_recv((True, microbatch, chunk), grad_spec(self.output_spec(microbatch, chunk)),
                        self._peer(microbatch, chunk, True), tag)

    def wait_gradient(self, microbatch: int, chunk: int) -> Boundary:
        return self._wait_recv((True, microbatch, chunk))

    def _splits(self, shape: torch.Size) -> bool:
        """Scatter/gather (ch. 4.4.1): tensor-parallel ranks hold identical boundary tensors, so each
        sends only its 1/t slice to its counterpart; the receivers all-gather. Both sides decide
        from the shape alone, so they always agree."""
        if not self.scatter_gather or self.tp is None or self.tp.size == 1:
            return False
        if math.prod(shape) % self.tp.size:
            if not self._warned_indivisible:
                self._warned_indivisible = True
                print(f"comm: a boundary tensor of shape {tuple(shape)} does not split into {self.tp.size} "
                      f"equal parts: sending it whole", flush=True)
            return False
        return True

    def connect(self) -> None:
        """Exchanges one small message on every channel of the layout, in one global order that
        every rank follows, so NCCL creates each pair's communicator here, where no rank can wait
        on another's compute, rather than at a pair's first message mid-schedule."""
        probe = torch.zeros(1, device=self.device)
        for src, dst in self.layout.p2p_channels():
            group = self.groups.carrying(src, dst)
            if self.rank == src:
                dist.isend(probe, dst, group=group).wait(self.timeout)
            elif self.rank == dst:
                dist.irecv(probe, src, group=group).wait(self.timeout)

    def _packing_parts(self) -> int:
        """A packed tuple is padded to split into this many equal parts (scatter/gather)."""
        return self.tp.size if self.scatter_gather and self.tp is not None else 1

    def _send(self, tensor: Boundary, dst: int, tag: int) -> None:
        if not isinstance(tensor, torch.Tensor):
            tensor = pack(tensor, self._packing_parts())
        if self.scatter_gather and self._splits(tensor.shape):
            tensor = scatter_chunk(tensor, self.tp)
        tensor = tensor.contiguous()
        work = dist.isend(tensor, dst, group=self.groups.carrying(self.rank, dst), tag=tag)
        self._sends.append(_Pending(work, tensor))
        self.stats.bytes_sent += tensor.numel() * tensor.element_size()
        self.stats.messages_sent += 1

    def _post_recv(self, key: tuple[bool, int, int], spec: Spec, src: int, tag: int) -> None:
        if key in self._recvs:
            return
        packed = spec if isinstance(spec, TupleSpec) else None
        shape, dtype = ((packed.packed_bytes(self._packing_parts()),), torch.uint8) if packed else spec
        gather_to = None
        if self.scatter_gather and self._splits(torch.Size(shape)):
            gather_to, shape = torch.Size(shape), (math.prod(shape) // self.tp.size,)
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        work = dist.irecv(buffer, src, group=self.groups.carrying(src, self.rank), tag=tag)
        self._recvs[key] = _Pending(work, buffer, gather_to, packed)

    def _wait_recv(self, key: tuple[bool, int, int]) -> Boundary:
        if key not in self._recvs:
            raise InvariantError(f"receive {key} was never posted: the schedule must place RECV before its consumer")
        pending = self._recvs.pop(key)
        pending.work.wait(self.timeout)
        self.stats.bytes_received += pending.buffer.numel() * pending.buffer.element_size()
        received = pending.buffer
        if pending.gather_to is not None:
            received = gather_chunks(pending.buffer, self.tp, pending.gather_to)
        return pending.unpack.unpack(received) if pending.unpack is not None else received

    def park(self) -> dict[tuple[bool, int, int], _Pending]:
        """Sets the posted receives aside (an asynchronous run between two steps), so that an
        evaluation's micro-batch ids cannot collide with them; ``unpark`` puts them back."""
        parked, self._recvs = self._recvs, {}
        return parked

    def unpark(self, parked: dict[tuple[bool, int, int], _Pending]) -> None:
        if self._recvs:
            raise InvariantError(f"receives {sorted(self._recvs)[:3]} are still posted: finish them before unpark")
        self._recvs = parked

    def wait_sends(self) -> None:
        """Completes outstanding sends (their buffers can then be freed)."""
        for pending in self._sends:
            pending.work.wait(self.timeout)
        self._sends.clear()
