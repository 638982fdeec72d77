"""Forward/backward pairs (``schedules.paired``): where dualpipev's lists have them (its main phase,
every rank), that zbv's and 1f1b's have none, and what the simulator charges for expert
parallelism's all-to-alls with and without pairs hiding them."""
from __future__ import annotations

import pytest

from pipedream.schedules import Kind, build_schedule, schedule_placement
from pipedream.schedules.issue_order import issue_order
from pipedream.schedules.paired import forward_backward_pairs, pair_partners
from pipedream.schedules.simulate import Costs, simulate


@pytest.mark.parametrize("pp, m", [(2, 4), (2, 8), (4, 8), (3, 12)])
def test_dualpipev_pairs_a_forward_with_the_other_chunks_backward_on_every_rank(pp, m) -> None:
    for rank, actions in enumerate(build_schedule("dualpipev", pp, m)):
        order = issue_order(actions)
        pairs = forward_backward_pairs(order)
        main_phase = m - 2 * pp + rank + 1          # F0 B1 F1 B0 steps: two pairs each
        assert len(pairs) >= 2 * main_phase > 0
        for pair in pairs.values():
            forward, backward = order[pair.forward], order[pair.backward]
            assert (forward.kind, backward.kind) == (Kind.FWD, Kind.BWD) and forward.chunk != backward.chunk
            assert all(order[k].kind is Kind.SEND_ACT and order[k].microbatch == forward.microbatch
                       for k in pair.forward_sends)
            assert not any(order[k].kind in (Kind.FWD, Kind.BWD, Kind.WEIGHT) for k in range(pair.forward + 1, pair.backward))


@pytest.mark.parametrize("name", ["zbv", "1f1b", "gpipe"])
def test_schedules_without_pairs(name) -> None:
    assert not any(forward_backward_pairs(issue_order(actions)) for actions in build_schedule(name, 2, 8))


def _busy(name: str, costs: Costs) -> list[float]:
    placement = schedule_placement(name, 2)
    result = simulate(build_schedule(name, 2, 8), costs, vpp=placement.vpp, peer=placement.peer, needs=placement.needs)
    return result.busy


def test_pairs_hide_the_all_to_all_behind_the_partners_compute() -> None:
    base = dict(forward=1.0, backward=2.0, weight_grad=1.0)    # F = B = W = 1 per chunk
    plain = _busy("dualpipev", Costs(**base))
    for seconds in (0.25, 1.5):
        waited = _busy("dualpipev", Costs(**base, all_to_all=seconds))
        hidden = _busy("dualpipev", Costs(**base, all_to_all=seconds, pairs_hide_all_to_all=True))
        for rank, actions in enumerate(build_schedule("dualpipev", 2, 8)):
            computes = sum(a.kind in (Kind.FWD, Kind.BWD) for a in actions)
            paired = len(pair_partners(actions))
            assert waited[rank] == pytest.approx(plain[rank] + seconds * computes)      # every F and B waits
            # a paired one waits for what its partner's 1 s of compute leaves
            assert hidden[rank] == pytest.approx(plain[rank] + seconds * (computes - paired)
                                                 + max(0.0, seconds - 1.0) * paired)
    assert _busy("1f1b", Costs(all_to_all=0.5, pairs_hide_all_to_all=True)) == \
        pytest.approx([b + 0.5 * 16 for b in _busy("1f1b", Costs())])   # nothing to pair: all of it waits
