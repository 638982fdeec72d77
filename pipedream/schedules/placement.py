"""Which virtual stage each (rank, chunk) holds, and so who talks to whom.

``round-robin`` (the default, interleaved 1F1B): chunk c of rank r is virtual stage c*p + r, so
the last virtual stage is on the last rank. ``vshape`` (ZB-V): even chunks go down the ranks and
odd chunks come back up, c*p + r for even c and c*p + p-1-r for odd c; with two chunks rank r
holds stages r and 2p-1-r, so rank 0 holds both the first and the last stage, and the turn at the
bottom of the V (stages p-1 and p, both on rank p-1) needs no message between ranks.

Pure data: schedules, the simulator and the stream model take ``peer``/``needs`` from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from pipedream.schedules.actions import Action, Kind, ScheduleError

PLACEMENTS = ("round-robin", "vshape")
_DOWNSTREAM = (Kind.SEND_ACT, Kind.RECV_GRAD)
_UPSTREAM = (Kind.RECV_ACT, Kind.SEND_GRAD)


@dataclass(frozen=True)
class Placement:
    pp: int
    vpp: int
    kind: str = "round-robin"

    def __post_init__(self) -> None:
        if self.kind not in PLACEMENTS:
            raise ValueError(f"placement {self.kind!r}: choose one of {', '.join(PLACEMENTS)}")

    @property
    def num_virtual_stages(self) -> int:
        return self.pp * self.vpp

    def virtual_stage(self, rank: int, chunk: int) -> int:
        if self.kind == "vshape" and chunk % 2:
            return chunk * self.pp + self.pp - 1 - rank
        return chunk * self.pp + rank

    def stage_of(self, virtual: int) -> tuple[int, int]:
        """Inverse of ``virtual_stage``: virtual stage -> (rank, chunk)."""
        chunk, offset = divmod(virtual, self.pp)
        if self.kind == "vshape" and chunk % 2:
            return self.pp - 1 - offset, chunk
        return offset, chunk

    def is_first(self, rank: int, chunk: int) -> bool:
        return self.virtual_stage(rank, chunk) == 0

    def is_last(self, rank: int, chunk: int) -> bool:
        return self.virtual_stage(rank, chunk) == self.num_virtual_stages - 1

    @cached_property
    def _answers(self) -> dict[tuple, object]:
        """Answers of ``peer``/``sends``/``needs`` by (what, rank, kind, chunk): schedule builders, the
        simulator and the stream model ask the same few of them once per action."""
        return {}

    def peer(self, rank: int, action: Action, pp: int | None = None, vpp: int | None = None) -> tuple[int, int]:
        """(rank, chunk) at the other end of a comm action; the simulator's ``peer`` signature."""
        key = ("peer", rank, action.kind, action.chunk)
        answer = self._answers.get(key)
        if answer is None:
            answer = self._answers[key] = self._peer(rank, action)   # raises for a missing peer: not kept
        return answer

    def _peer(self, rank: int, action: Action) -> tuple[int, int]:
        if action.kind in _DOWNSTREAM:
            step = 1
        elif action.kind in _UPSTREAM:
            step = -1
        else:
            raise ValueError(f"{action} is not a communication action")
        target = self.virtual_stage(rank, action.chunk) + step
        if not 0 <= target < self.num_virtual_stages:
            raise ScheduleError(f"rank {rank}: {action} has no peer (virtual stage {target} does not exist "
                                f"with pp = {self.pp}, vpp = {self.vpp}, {self.kind} placement)")
        return self.stage_of(target)

    def is_local(self, rank: int, chunk: int, step: int) -> bool:
        """Whether virtual stage ``step`` (+1 or -1) away from (rank, chunk) is on ``rank`` too: the
        bottom of a V, where a tensor changes chunk without a message (a schedule orders the two)."""
        target = self.virtual_stage(rank, chunk) + step
        return 0 <= target < self.num_virtual_stages and self.stage_of(target)[0] == rank

    def sends(self, rank: int, action: Action) -> Action | None:
        """The send that follows compute ``action``, or None (last/first stage, a local hand-over, WEIGHT)."""
        key = ("sends", rank, action.kind, action.chunk)
        kind = self._answers.get(key)
        if kind is None:
            kind = self._answers[key] = self._message_kind(rank, action, sending=True)
        return None if kind is False else Action(kind, action.microbatch, action.chunk)

    def needs(self, rank: int, action: Action) -> Action | None:
        """The RECV whose message ``action`` consumes, or None (WEIGHT never needs one)."""
        key = ("needs", rank, action.kind, action.chunk)
        kind = self._answers.get(key)
        if kind is None:
            kind = self._answers[key] = self._message_kind(rank, action, sending=False)
        return None if kind is False else Action(kind, action.microbatch, action.chunk)

    def _message_kind(self, rank: int, action: Action, sending: bool) -> Kind | bool:
        """The kind of the send after (``sending``) or the receive before compute ``action``, or False."""
        if action.kind is Kind.FWD:
            edge, step = (self.is_last, 1) if sending else (self.is_first, -1)
            if not edge(rank, action.chunk) and not self.is_local(rank, action.chunk, step):
                return Kind.SEND_ACT if sending else Kind.RECV_ACT
        if action.kind is Kind.BWD:
            edge, step = (self.is_first, -1) if sending else (self.is_last, 1)
            if not edge(rank, action.chunk) and not self.is_local(rank, action.chunk, step):
                return Kind.SEND_GRAD if sending else Kind.RECV_GRAD
        return False
