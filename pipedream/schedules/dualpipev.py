"""DualPipe-V (DeepSeek-V3's DualPipe folded onto a V of p ranks; as DeepSeek's open-source
``dualpipev`` and torch's ``ScheduleDualPipeV``), in this IR.

The placement is zbv's: rank r holds virtual stages r and 2p-1-r. Every rank walks eight phases
(m >= 2p micro-batches): forwards of chunk 0, pairs of chunk-0/chunk-1 forwards, zero-bubble
B1 W F1 steps, the main phase of F0 B1 F1 B0 pairs, then backwards whose second half is split into
B and W so the Ws fill the drain. DualPipe runs each F+B pair of the main phase at the same time on
two streams so each one's communication (expert-parallel all-to-all in DeepSeek-V3) hides behind
the other's compute; in this IR a pair is its forward then its backward, which the runtime runs at
the same time under expert parallelism (``parallel.ep_overlap``, ``schedules.paired``). A whole backward is BWD followed
at once by its WEIGHT, since a list with WEIGHT actions splits every backward.
"""
from __future__ import annotations

from collections import deque

from pipedream.schedules.actions import Action, Kind
from pipedream.schedules.common import add_communication, check_sizes, flush_update
from pipedream.schedules.info import ScheduleInfo, SizeRule
from pipedream.schedules.placement import Placement
from pipedream.schedules.zbv import CHUNKS, v_shape_rule


def _rank_order(rank: int, pp: int, microbatches: int) -> list[Action]:
    order: list[Action] = []
    next_mb = {(Kind.FWD, 0): 0, (Kind.FWD, 1): 0, (Kind.BWD, 0): 0, (Kind.BWD, 1): 0}
    held: deque[Action] = deque()      # split backwards whose W is still to run, oldest first

    def forward(chunk: int) -> None:
        order.append(Action(Kind.FWD, next_mb[(Kind.FWD, chunk)], chunk))
        next_mb[(Kind.FWD, chunk)] += 1

    def backward(chunk: int, split: bool = False) -> None:
        mb = next_mb[(Kind.BWD, chunk)]
        next_mb[(Kind.BWD, chunk)] += 1
        order.append(Action(Kind.BWD, mb, chunk))
        if split:
            held.append(Action(Kind.WEIGHT, mb, chunk))
        else:
            order.append(Action(Kind.WEIGHT, mb, chunk))

    def weight() -> None:
        if held:
            order.append(held.popleft())

    for _ in range((pp - rank - 1) * 2):           # 1: chunk-0 forwards
        forward(0)
    for _ in range(rank + 1):                       # 2: F0 F1
        forward(0)
        forward(1)
    for _ in range(pp - rank - 1):                  # 3: B1 W1 F1 (zero bubble)
        backward(1, split=True)
        weight()
        forward(1)
    for _ in range(microbatches - 2 * pp + rank + 1):   # 4: F0 B1, F1 B0 (DualPipe's overlapped pairs)
        forward(0)
        backward(1)
        forward(1)
        backward(0)
    for _ in range(pp - rank - 1):                  # 5: B1, F1 B0
        backward(1)
        forward(1)
        backward(0)
    split = False
    for i in range(rank + 1):                       # 6: B1 B0, the second half split
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        backward(1, split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        backward(0, split)
    for _ in range(pp - rank - 1):                  # 7: W B0
        weight()
        backward(0, split=True)
    while held:                                     # 8: the remaining Ws
        weight()
    return order


def dualpipev(pp: int, microbatches: int, vpp: int = CHUNKS) -> list[list[Action]]:
    check_sizes(pp, microbatches, vpp)
    INFO.check(pp, microbatches, vpp)
    placement = Placement(pp, CHUNKS, "vshape")
    compute = [_rank_order(rank, pp, microbatches) for rank in range(pp)]
    return [actions + flush_update() for actions in add_communication(compute, pp, CHUNKS, placement)]


INFO = ScheduleInfo(
    name="dualpipev", build=dualpipev, split_backward=True, placement="vshape", fixed_chunks=CHUNKS,
    overlaps_all_to_all=True,
    refuses=(v_shape_rule("dualpipev"),
             SizeRule(lambda p, m, v: m >= 2 * p,
                      lambda p, m, v: f"schedule dualpipev needs microbatches >= 2 * pp = {2 * p} (got {m}): "
                                      f"raise the micro-batches per step or use schedule=zbv")),
    bubble=lambda p, m, v: (p - 1) / (6 * m), bubble_rule="(p-1)/(6m) with t_w = t_b/2",   # zbv's at best
    in_flight=lambda stage, p, m, v: 2 * p + 1 + 0 * (stage + m))   # one pair more than zbv's 2p, at every rank
