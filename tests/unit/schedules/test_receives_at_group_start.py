"""Harmony's issue order on Gloo: every receive is posted right after its task's latest pack
swap-in (a group's start), never later than one compute ahead, and nothing else moves."""
from __future__ import annotations

import pytest

from pipedream.schedules.actions import Kind, parse_actions
from pipedream.schedules.harmony import harmony_config, harmony_pp
from pipedream.schedules.issue_order import issue_order, receives_at_group_start

RECEIVES = (Kind.RECV_ACT, Kind.RECV_GRAD)


def test_receives_move_to_their_groups_swap_in():
    actions = parse_actions("SI.1 RA0.1 F0.1 SA0.1 RA1.1 F1.1 SA1.1 RA2.1 F2.1 SA2.1 SO.1")
    assert receives_at_group_start(actions) == parse_actions(
        "SI.1 RA0.1 RA1.1 RA2.1 F0.1 SA0.1 F1.1 SA1.1 F2.1 SA2.1 SO.1")


def test_a_receive_before_its_groups_swap_in_keeps_the_one_compute_ahead_place():
    actions = parse_actions("SI F0 SA0 F1 SA1 SO RA0.2 SI.2 F0.2 SA0.2")
    assert receives_at_group_start(actions) == issue_order(actions)


@pytest.mark.parametrize("devices, forward, backward, group", [
    (2, [2, 2, 2, 2], [4, 2, 2], None), (2, [3, 3, 2], [2, 2, 2, 2], 2), (4, [1] * 6 + [2], [1] * 6 + [2], 1)])
def test_harmony_lists_keep_every_action_and_post_each_receive_in_its_group(devices, forward, backward, group):
    config = harmony_config(8, 8, devices, forward_packs=forward, backward_packs=backward,
                            forward_group=group, backward_group=group)
    for actions in harmony_pp(config):
        order = receives_at_group_start(actions)
        assert sorted(map(str, order)) == sorted(map(str, actions))
        others = [a for a in order if a.kind not in RECEIVES]
        assert others == [a for a in actions if a.kind not in RECEIVES]
        ahead = issue_order(actions)
        for i, a in enumerate(order):
            if a.kind not in RECEIVES:
                continue
            before = ahead[:ahead.index(a)]   # what issue_order issues before it: no later here
            issued_here = [b for b in order[:i] if b.kind not in RECEIVES]
            assert len(issued_here) <= len([b for b in before if b.kind not in RECEIVES])
            swap_ins = [b for b in before if b.kind is Kind.SWAP_IN and b.microbatch < 0 and b.chunk == a.chunk]
            if swap_ins:   # right after the latest swap-in of its task's pack, with other receives
                last = max(j for j, b in enumerate(order[:i]) if b == swap_ins[-1])
                assert all(b.kind in RECEIVES for b in order[last + 1:i])
