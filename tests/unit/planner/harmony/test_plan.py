"""planner.algorithm=harmony end to end without processes: the plan file's harmony section, auto's
fall-back when no other plan fits, and the one-line refusals."""
from __future__ import annotations

from dataclasses import replace

import pytest

from pipedream.devices import DEVICES, GIB
from pipedream.config.plan_file import PlanError, load_plan, plan_from_json
from planner.__main__ import main
from planner.search.auto import make_plan
from planner.errors import DoesNotFitError, PlannerError
from planner.inputs.hardware import Cluster, Level
from planner.inputs.search_inputs import Inputs
from planner.inputs.model_specs import TransformerSpec
from planner.inputs.profile import analytic_profile

H200 = DEVICES["h200"]
SPEC = TransformerSpec("g", "gpt", 24, 2048, 16, 512, 8192, "bf16")


def one_server(devices=4, memory=H200.memory_bytes, nodes=1):
    device = replace(H200, memory_bytes=memory)
    levels = (Level("nv", devices, 450e9, 5e-6),) + ((Level("ib", nodes, 50e9, 1e-5),) if nodes > 1 else ())
    return Cluster("c", device, levels, devices, extra={"host_bandwidth": 63e9})


def inputs(memory=H200.memory_bytes, budget=None, nodes=1, devices=4):
    return Inputs("g", analytic_profile(SPEC, H200), one_server(devices, memory, nodes), 16, SPEC,
                  reserve_gib=0.0, reserve_fraction=0.0, max_micro_batch=8, device_budget=budget)


def test_harmony_plan_round_trips_through_the_plan_file(tmp_path):
    weights = analytic_profile(SPEC, H200).arrays["parameter_bytes"].sum()
    out = make_plan(inputs(budget=weights / 4), "harmony")
    plan, h = out.plan, out.plan.harmony
    assert plan.schedule == "harmony_pp" and plan.world_size == 4 and plan.stages == ()
    assert h.backward_packs[0][0] == 0 and h.backward_packs[-1][1] == SPEC.num_layers + 2  # embedding + blocks + head
    assert h.forward_packs[-1] == h.backward_packs[-1]                                     # the jit pack
    assert max(plan.planner["peak_bytes_per_device"]) <= weights / 4
    assert plan.batch.micro * plan.batch.num_microbatches == 16 and h.forward_group == plan.batch.num_microbatches
    path = tmp_path / "plan.json"
    plan.save(path)
    assert load_plan(path) == plan
    load_plan(path).check_world_size(4)


def test_auto_falls_back_to_harmony_when_nothing_else_fits():
    # 4 GiB devices: 1.2B parameters x 16 bytes (bf16 weights and gradients, fp32 master, Adam) need
    # 19 GiB, more than 4 devices hold
    out = make_plan(inputs(memory=4 * GIB))
    assert out.plan.schedule == "harmony_pp"
    assert out.reason.startswith("no ptdp plan fits device memory")
    with pytest.raises(DoesNotFitError):  # several servers: Harmony is not an option, the refusal stays
        make_plan(inputs(memory=1 * GIB, nodes=2))


def test_refusals_are_one_line():
    with pytest.raises(DoesNotFitError, match=r"layer \d+ \(\w+\) alone needs .* > the budget"):
        make_plan(inputs(budget=1e6), "harmony")
    with pytest.raises(PlannerError, match="plans one server"):
        make_plan(inputs(nodes=2), "harmony")


def test_bad_harmony_sections():
    base = {"version": 1, "model": {"name": "m", "num_layers": 4}, "cluster": {"num_devices": 2},
            "parallel": {"pp": 2, "tp": 1, "dp": 1}, "schedule": "harmony_pp",
            "batch": {"global": 4, "micro": 2, "num_microbatches": 2}, "recompute": "full", "stages": [],
            "harmony": {"forward_packs": [[0, 2], [2, 4]], "backward_packs": [[0, 1], [1, 2], [2, 4]],
                        "forward_group": 2, "backward_group": 1, "devices": 2, "device_budget_bytes": 1e9}}
    assert plan_from_json(base).world_size == 2
    for change, message in [({"backward_packs": [[0, 2], [3, 4]]}, "must split"),
                            ({"forward_packs": [[0, 3]]}, "covers \\[0, 3\\)"),
                            ({"forward_packs": [[0, 1], [1, 4]]}, "must be the same"),
                            ({"forward_group": 3}, "between 1 and 2"), ({"device_budget_bytes": -1}, "positive")]:
        with pytest.raises(PlanError, match=message):
            plan_from_json({**base, "harmony": {**base["harmony"], **change}})
    with pytest.raises(PlanError, match="missing harmony"):
        plan_from_json({k: v for k, v in base.items() if k != "harmony"})


def test_cli_refuses_an_impossible_budget(capsys):
    code = main(["model=gpt_small", "cluster=h200_x8", "cluster.nodes=1", "planner.algorithm=harmony",
                 "planner.device_budget_bytes=1000"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and err.startswith("error: planner.device_budget_bytes=1000")


def test_a_harmony_plan_folds_into_the_runtime_keys(tmp_path, capsys):
    from pipedream.config.plan_config import apply_plan, check_plan_world_size
    from tests.support.training_harness import compose_config

    path = tmp_path / "harmony.json"
    assert main(["model=gpt_tiny", "cluster=local_cpu", "train.global_batch_size=8", "planner.algorithm=harmony",
                 "planner.device_budget_bytes=6000000", f"planner.out={path}"]) == 0, capsys.readouterr().err
    plan = load_plan(path)
    cfg = apply_plan(compose_config(["model=gpt_tiny", "train.global_batch_size=8", f"parallel.plan={path}"]))
    check_plan_world_size(compose_config(["model=gpt_tiny", f"parallel.plan={path}"]), plan.harmony.devices)
    assert cfg.schedule.name == "harmony_pp" and cfg.parallel.pp == plan.harmony.devices
    assert cfg.schedule.forward_packs == [e - s for s, e in plan.harmony.forward_packs]
    assert cfg.schedule.backward_packs == [e - s for s, e in plan.harmony.backward_packs]
    assert cfg.schedule.backward_group == plan.harmony.backward_group
    assert cfg.memory.device_budget_bytes == 6000000 and cfg.train.micro_batch_size == plan.batch.micro
    assert sum(cfg.schedule.forward_packs) == sum(cfg.schedule.backward_packs) == plan.model.num_layers


def test_cpu_slots_from_the_calibration():
    from planner.harmony.plan import cpu_slots

    # 2 processes each 1.97x slower when both compute: about one at a time
    assert cpu_slots({"processes": 2, "matmul_slowdown_all_busy": 1.97, "cores": 2}) == 1
    # 4 processes no slower all busy (a loaded machine hides the contention): at most the cores
    assert cpu_slots({"processes": 4, "matmul_slowdown_all_busy": 1.0, "cores": 2}) == 2
    assert cpu_slots({"processes": 4, "matmul_slowdown_all_busy": 1.3, "cores": 16}) == 3


def test_one_cpu_device_computes_at_the_calibrated_alone_speed():
    from types import MappingProxyType

    from planner.harmony.plan import harmony_profile
    from tests.support.planner_helpers import random_profile
    import random

    profile = replace(random_profile(random.Random(1), 3), source="measured")
    sheet = {"matmul_slowdown_all_busy": 2.0, "processes": 2}
    cluster = Cluster("m", H200, (Level("p2p", 2, 1e9),), 2, "cpu", MappingProxyType({"sheet": sheet}))
    inp = Inputs("m", profile, cluster, 8)
    alone = harmony_profile(inp, 1)
    assert alone.layers[1].forward_s[0] == pytest.approx(profile.layers[1].forward_s[0] / 2)
    assert harmony_profile(inp, 2) is profile   # two devices: the all-busy times, as calibrated
    # with harmony_pp's own costs in the sheet (their ratios are over the layers timed alone, contention
    # included) every device count starts from the layers alone
    from planner.harmony.estimator import HarmonyOverheads
    costed = replace(inp, harmony_costs=MappingProxyType({2: HarmonyOverheads(train_ratio=1.5)}))
    assert harmony_profile(costed, 2).layers[1].backward_s[0] == pytest.approx(profile.layers[1].backward_s[0] / 2)
    # the layers timed alone around the harmony runs, where the sheet has them, for every device count
    timed_alone = replace(random_profile(random.Random(2), 3), source="measured")
    with_alone = replace(costed, harmony_alone_profile=timed_alone)
    assert harmony_profile(with_alone, 1) is timed_alone and harmony_profile(with_alone, 4) is timed_alone


def test_the_harmony_section_gives_the_layers_timed_alone():
    from planner.harmony.costs import alone_profile
    from tests.support.planner_helpers import random_profile
    import random

    profile = replace(random_profile(random.Random(3), 3), source="measured")
    entry = {"runtime": {"harmony": {"2": {"train_ratio": 1.2}, "profile_alone": profile.to_json()}}}
    assert alone_profile(entry).layers == profile.layers
    assert alone_profile({"runtime": {"harmony": {"2": {"train_ratio": 1.2}}}}) is None   # an older sheet


def test_the_estimator_takes_the_median_of_the_families_runtime_costs():
    from types import MappingProxyType

    from planner.harmony.estimator import HarmonyOverheads
    from planner.harmony.plan import harmony_overheads, run_harmony
    from planner.inputs.runtime_costs import RuntimeCosts, ScheduleOverheads

    # one family's run stalled (9 s per message): the median of the three is the middle one's
    families = {"flush": ScheduleOverheads(1e-3, 9.0, 0.5), "2bw": ScheduleOverheads(3e-3, 2e-3, 0.4),
                "pipedream": ScheduleOverheads(2e-3, 1e-3, 0.6)}
    costed = replace(inputs(), runtime=RuntimeCosts(MappingProxyType(families)))
    assert harmony_overheads(costed) == HarmonyOverheads(2e-3, 2e-3, 0.5)   # no harmony_pp runs in the sheet
    assert harmony_overheads(inputs()) == HarmonyOverheads()
    # every configuration takes longer with the costs, so the best one does too
    plain, with_costs = run_harmony(replace(inputs(), top_k=0))[0].best, run_harmony(replace(costed, top_k=0))[0].best
    assert with_costs.iteration_s > plain.iteration_s
