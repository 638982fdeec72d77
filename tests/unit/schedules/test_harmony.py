"""Harmony's wrap-around schedule as data (pipedream.schedules.harmony): coverage, updates, the
binding rule, swaps around every use, message order, configuration errors and the printed form."""
from __future__ import annotations

import itertools

import pytest

from pipedream.schedules import ScheduleError
from pipedream.schedules.__main__ import main
from pipedream.schedules.actions import Action, Kind
from pipedream.schedules.harmony import BACKWARD, FORWARD, JIT, HarmonyConfig, harmony_config, harmony_pp
from pipedream.schedules.simulate import check_channel_order

CONFIGS = [
    dict(num_layers=1, microbatches=1, devices=1),
    dict(num_layers=4, microbatches=2, devices=1),
    dict(num_layers=6, microbatches=4, devices=2),
    dict(num_layers=6, microbatches=4, devices=2, forward_packs=[1, 2, 2, 1], backward_packs=[2, 1, 2, 1],
         forward_group=4, backward_group=2),
    dict(num_layers=7, microbatches=5, devices=4, forward_packs=[3, 2, 2], backward_packs=[1, 1, 1, 2, 2],
         forward_group=2, backward_group=3),
    dict(num_layers=9, microbatches=3, devices=3, forward_group=1, backward_group=1),
    dict(num_layers=5, microbatches=8, devices=4, forward_packs=[2, 3], backward_packs=[1, 1, 3]),
    dict(num_layers=3, microbatches=2, devices=3, forward_packs=[3], backward_packs=[3]),
]


def build(case: dict) -> tuple[HarmonyConfig, list[list[Action]]]:
    config = harmony_config(**case)
    return config, harmony_pp(config)


@pytest.mark.parametrize("case", CONFIGS)
def test_every_layer_runs_forward_and_backward_once_per_microbatch(case):
    config, schedule = build(case)
    done = {Kind.FWD: [], Kind.BWD: []}
    for actions in schedule:
        for a in actions:
            if a.kind in done:
                first, stop = config.tasks[a.chunk].layers
                done[a.kind] += [(layer, a.microbatch) for layer in range(first, stop)]
    expected = sorted(itertools.product(range(config.num_layers), range(config.microbatches)))
    assert sorted(done[Kind.FWD]) == expected
    assert sorted(done[Kind.BWD]) == expected


@pytest.mark.parametrize("case", CONFIGS)
def test_each_pack_updates_once_right_after_its_last_backward(case):
    config, schedule = build(case)
    updated = []
    for actions in schedule:
        for k, a in enumerate(actions):
            if a.kind is Kind.UPDATE:
                task = config.tasks[a.chunk]
                assert task.role in (JIT, BACKWARD)
                updated += list(range(*task.layers))
                later = actions[k + 1:]
                assert not any(b.kind is Kind.BWD and b.chunk == a.chunk for b in later)
                # nothing of another task runs between the pack's last backward and its update
                last_bwd = max(j for j, b in enumerate(actions[:k]) if b.kind is Kind.BWD and b.chunk == a.chunk)
                assert all(b.chunk == a.chunk or b.kind in (Kind.PREFETCH, Kind.SEND_GRAD, Kind.RECV_GRAD)
                           for b in actions[last_bwd + 1:k])
    assert sorted(updated) == list(range(config.num_layers))


@pytest.mark.parametrize("case", CONFIGS)
def test_wrap_around_binding(case):
    config, schedule = build(case)
    roles = [t.role for t in config.tasks]
    assert roles == [FORWARD] * (len(config.forward_packs) - 1) + [JIT] + [BACKWARD] * (len(config.backward_packs) - 1)
    assert [t.layers for t in config.tasks] == list(config.forward_packs) + list(reversed(config.backward_packs[:-1]))
    for device, actions in enumerate(schedule):
        for a in actions:
            if a.kind in (Kind.SWAP_OUT, Kind.SWAP_IN) and a.microbatch >= 0 and a.kind is Kind.SWAP_OUT:
                owner = config.stash_source(config.tasks[a.chunk])   # a stash leaves the forward device
            else:
                owner = config.tasks[a.chunk]
            assert owner.device == device == owner.index % config.devices, (device, a)


@pytest.mark.parametrize("case", CONFIGS)
def test_swaps_bracket_every_use(case):
    config, schedule = build(case)
    written = set()
    for actions in schedule:   # forward tasks precede every backward: stashes are written first
        written |= {(a.microbatch, a.chunk) for a in actions if a.kind is Kind.SWAP_OUT and a.microbatch >= 0}
    read = []
    weight_swaps = [0] * config.num_layers
    for device, actions in enumerate(schedule):
        resident: set[int] = set()
        prefetched: set[int] = set()
        for k, a in enumerate(actions):
            if a.kind is Kind.PREFETCH:
                prefetched.add(a.chunk)
            elif a.kind is Kind.SWAP_IN and a.microbatch < 0:
                assert a.chunk not in resident
                resident.add(a.chunk)
                prefetched.discard(a.chunk)
                for layer in range(*config.tasks[a.chunk].layers):
                    weight_swaps[layer] += 1
            elif a.kind is Kind.SWAP_OUT and a.microbatch < 0:
                resident.remove(a.chunk)
            elif a.kind in (Kind.FWD, Kind.BWD, Kind.UPDATE):
                assert (a.chunk in resident) != (a.kind is Kind.UPDATE), (device, a)   # update: on the host
            if a.kind is Kind.BWD and config.tasks[a.chunk].role == BACKWARD:
                assert actions[k - 1] == Action(Kind.SWAP_IN, a.microbatch, a.chunk) or \
                    actions[k - 2] == Action(Kind.SWAP_IN, a.microbatch, a.chunk)
                read.append((a.microbatch, a.chunk))
        assert not resident and not prefetched
    assert sorted(read) == sorted(written)
    assert len(read) == len(set(read)) == config.microbatches * (len(config.backward_packs) - 1)
    # with one group per task (the default) the weights come in twice per layer, once for the shared last pack
    if case.get("forward_group") is None and case.get("backward_group") is None:
        jit_first, jit_stop = config.forward_packs[-1]
        assert weight_swaps == [1 if jit_first <= layer < jit_stop else 2 for layer in range(config.num_layers)]


@pytest.mark.parametrize("case", CONFIGS)
def test_messages_pair_in_order_and_forwards_wait_for_their_input(case):
    config, schedule = build(case)
    placement = config.placement()
    check_channel_order(schedule, config.devices, len(config.tasks), placement.peer)
    for device, actions in enumerate(schedule):
        for k, a in enumerate(actions):
            need = placement.needs(device, a)
            if need is not None:
                assert need in actions[:k]
            if a.kind is Kind.SEND_ACT:   # sent after the stashes of the same forward are out
                assert actions[k - 1].kind in (Kind.FWD, Kind.SWAP_OUT)
            if a.kind is Kind.SWAP_IN and a.microbatch >= 0 and need is None:
                # a stash is read only after the gradient that follows its writing has been posted
                gradient = placement.needs(device, Action(Kind.BWD, a.microbatch, a.chunk))
                assert gradient is None or gradient in actions[:k]


def test_jit_pack_runs_each_backward_straight_after_its_forward():
    config, schedule = build(CONFIGS[3])
    jit = next(t for t in config.tasks if t.role == JIT)
    computes = [a for a in schedule[jit.device] if a.chunk == jit.index and a.kind in (Kind.FWD, Kind.BWD)]
    assert computes == [Action(kind, mb, jit.index) for mb in range(4) for kind in (Kind.FWD, Kind.BWD)]


@pytest.mark.parametrize("case, message", [
    (dict(forward_packs=[2, 2], backward_packs=[3, 1]), "must be the same layers"),
    (dict(forward_packs=[2, 1]), "sum to 3 layers but the model has 4"),
    (dict(backward_packs=[2, 0, 2]), "positive integers"),
    (dict(forward_group=5), "forward_group = 5 exceeds the 4 micro-batches"),
    (dict(backward_group=0), "backward_group = 0 must be an integer >= 1"),
    (dict(devices=0), "devices = 0 must be an integer >= 1"),
    (dict(mode="dp"), "mode = 'dp' is not supported"),
])
def test_bad_configurations_are_one_line_errors(case, message):
    args = dict(num_layers=4, microbatches=4, devices=2) | case
    with pytest.raises(ScheduleError, match=message) as info:
        harmony_config(**args)
    assert "\n" not in str(info.value)


def test_packs_must_be_consecutive():
    with pytest.raises(ScheduleError, match="consecutive"):
        HarmonyConfig(4, ((0, 2), (3, 4)), ((0, 2), (3, 4)), 2, 2, 2, 1)


def test_the_cli_prints_tasks_and_device_lists(capsys):
    assert main(["--schedule", "harmony_pp", "--pp", "2", "--microbatches", "2", "--layers", "4",
                 "--forward-packs", "2,2", "--backward-packs", "1,1,2", "--backward-group", "1"]) == 0
    out = capsys.readouterr().out
    assert "forward+backward  [2, 4)" in out
    assert "device 0: SI F0 SO0.2 SO0.3 SA0 PF.2 F1" in out
    assert main(["--schedule", "harmony_pp", "--pp", "2", "--microbatches", "2"]) == 2
    assert "needs --layers" in capsys.readouterr().err
    assert main(["--schedule", "harmony_pp", "--pp", "2", "--microbatches", "2", "--layers", "4",
                 "--forward-packs", "2,x"]) == 2


def test_action_text_round_trips():
    from pipedream.schedules.actions import format_actions, parse_actions
    for case in CONFIGS:
        for actions in build(case)[1]:
            assert parse_actions(format_actions(actions)) == actions


def test_deadlock_free_under_nccl_rules_with_one_group_per_direction():
    """What the runtime runs: each device's list, then the loss all-reduce of every rank (None)."""
    from pipedream.schedules.simulate import DeadlockError
    from pipedream.schedules.stream_model import check_stream_order
    checked = 0
    for layers, devices, m in itertools.product(range(1, 10), range(1, 6), (1, 2, 3, 4, 8)):
        for forward_group, backward_group in {(1, 1), (m, m), (2 if m > 1 else 1, 1), (m, 1)}:
            config = harmony_config(layers, m, devices, forward_group=forward_group, backward_group=backward_group)
            orders = [actions + [None] for actions in harmony_pp(config)]
            placement = config.placement()
            for streams in ("direction", "channel"):
                check_stream_order(orders, devices, len(config.tasks), streams=streams, peer=placement.peer,
                                   needs=placement.needs)
            checked += 1
    assert checked > 500
    # both directions on one stream per pair of ranks (one group) can hang: hence the two groups
    config = harmony_config(2, 2, 2)
    with pytest.raises(DeadlockError):
        check_stream_order([a + [None] for a in harmony_pp(config)], 2, len(config.tasks), streams="pair",
                           peer=config.placement().peer, needs=config.placement().needs)
