"""The zero-bubble schedules train for real: zb_h2 and zbv (W actions, zbv's V placement) give the
same losses and parameters as single-process training (fp32), with recomputation and tied
weights, on (pp, dp) in {(2, 1), (4, 1), (2, 2)} (dualpipev, which needs m >= 2p, on pp 2 and 4); and each rank's measured peak in-flight
micro-batches and stash bytes equal the simulator's prediction for the same action lists."""
from __future__ import annotations

import json

import pytest

from pipedream.schedules import Kind, build_schedule, schedule_placement
from pipedream.schedules.simulate import Costs, simulate
from tests.support.checkpoint_harness import logged_losses, losses_across_resume, train_full, train_interrupted
from tests.support.training_harness import TINY_GPT, assert_matches_reference, merge_params, reference_training, train_rank
from tests.support.workers import run_workers

LAYOUTS = [(schedule, pp, dp) for schedule in ("zb_h2", "zbv") for pp, dp in ((2, 1), (4, 1), (2, 2))]
LAYOUTS += [("dualpipev", 2, 1), ("dualpipev", 4, 1)]
BATCH = {("dualpipev", 4, 1): ["train.global_batch_size=16"]}   # dualpipev needs m >= 2p
SGD = ["optim=sgd", "train.lr=0.05"]
VARIANTS = {
    "untied": SGD + ["model.tie_embeddings=false"],
    "recompute": SGD + ["model.tie_embeddings=false", "recompute.granularity=full"],
    "tied": SGD + ["model.tie_embeddings=true"],
}
STEPS = 3
RUNS = [("zb_h2", []), ("zbv", []), ("zb_h2", ["recompute.granularity=full"])]   # in-flight check


@pytest.mark.slow
@pytest.mark.parametrize("schedule,pp,dp", LAYOUTS, ids=[f"{s}-pp{p}-dp{d}" for s, p, d in LAYOUTS])
def test_zero_bubble_matches_single_process(tmp_path, schedule, pp, dp):
    base = TINY_GPT + [f"train.steps={STEPS}", f"schedule={schedule}", f"parallel.pp={pp}", f"parallel.dp={dp}",
                       *BATCH.get((schedule, pp, dp), [])]
    runs = [(base + extra, str(tmp_path / name)) for name, extra in VARIANTS.items()]
    per_rank = run_workers(train_rank, pp * dp, runs)
    for index, (name, extra) in enumerate(VARIANTS.items()):
        result = merge_params([rank_results[index] for rank_results in per_rank])
        reference = reference_training(base + extra)
        assert_matches_reference({"params": result, "losses": per_rank[0][index]["losses"]}, reference)


@pytest.mark.slow
def test_measured_in_flight_and_stash_equal_the_simulation(tmp_path):
    runs = [(TINY_GPT + ["train.steps=2", f"schedule={name}", "parallel.pp=2", *extra], str(tmp_path / f"{name}{i}"))
            for i, (name, extra) in enumerate(RUNS)]
    per_rank = run_workers(train_rank, 2, runs)
    for index, (name, _) in enumerate(RUNS):
        summary = per_rank[0][index]["summary"]
        ranks = summary["ranks"]
        per_microbatch = {(s["pp_rank"], chunk): nbytes for s in ranks
                          for chunk, nbytes in s["stash_bytes_per_microbatch"].items()}
        m = summary["batch"]["num_microbatches"]
        placement = schedule_placement(name, 2)
        predicted = simulate(build_schedule(name, 2, m), Costs(stash_bytes=per_microbatch), vpp=placement.vpp,
                             peer=placement.peer, needs=placement.needs)
        for stats in ranks:
            assert stats["peak_in_flight"] == predicted.peak_in_flight[stats["pp_rank"]], (name, stats)
            assert stats["peak_stash_bytes"] == predicted.peak_stash_bytes[stats["pp_rank"]], (name, stats)
        if name == "zb_h2":   # min(2p - 1, m) at every stage, against 1F1B's [2, 1]
            assert [s["peak_in_flight"] for s in ranks] == [min(3, m)] * 2



@pytest.mark.slow
def test_tensor_parallel_zero_bubble_matches_dense_single_process(tmp_path):
    """tp = 2 inside both zero-bubble schedules: W runs the tensor-parallel linears' held GEMMs."""
    base = TINY_GPT + ["train.steps=3", "parallel.pp=2", "parallel.tp=2", "optim=sgd", "train.lr=0.05",
                       "model.vocab_size=255"]
    schedules = ["schedule=zb_h2", "schedule=zbv"]
    per_rank = run_workers(train_rank, 4, [(base + [s], str(tmp_path / s[9:])) for s in schedules])
    for index, schedule in enumerate(schedules):
        result = merge_params([rank_results[index] for rank_results in per_rank])
        assert_matches_reference({"params": result, "losses": per_rank[0][index]["losses"]},
                                 reference_training(base + [schedule]))


@pytest.mark.slow
def test_zbv_checkpoint_resumes_into_1f1b(tmp_path):
    """A checkpoint of the V placement (rank 0 holds the first and the last layers) reshards by
    layer name into round-robin 1F1B and continues like an uninterrupted zbv run."""
    # tied: zbv's rank 0 holds the embedding and the head as one Parameter; 1f1b splits them
    base = TINY_GPT + ["optim=sgd", "train.lr=0.05", "train.steps=4", "checkpoint.every=2", "parallel.pp=2",
                       "model.tie_embeddings=true"]
    full = run_workers(train_full, 2, base + ["schedule=zbv"], str(tmp_path / "full"))
    run_dir = tmp_path / "resharded"
    run_workers(train_interrupted, 2, base + ["schedule=zbv"], str(run_dir), 2)
    resumed = run_workers(train_full, 2, base + ["schedule=1f1b", "train.resume=auto"], str(run_dir))
    assert_matches_reference({"params": merge_params(resumed), "losses": losses_across_resume(run_dir, 2, 4)},
                             {"params": merge_params(full), "losses": logged_losses(tmp_path / "full", 4)})


@pytest.mark.slow
def test_trace_shows_every_w_in_schedule_order(tmp_path):
    """A traced zbv run: each rank's trace holds every action of its list once, W events included,
    in the list's order, and the measured and predicted timelines are drawn."""
    overrides = ["model=mlp", "data=synthetic", "model.num_layers=4", "model.hidden_size=32",
                 "train.global_batch_size=16", "train.micro_batch_size=4", "train.steps=3", "train.log_every=1",
                 "train.eval_every=0", "train.progress=false", "optim=sgd", "schedule=zbv", "parallel.pp=2",
                 "trace.steps=[2,3]"]
    summary = run_workers(train_rank, 2, [(overrides, str(tmp_path / "zbv"))])[0][0]["summary"]
    schedule = build_schedule("zbv", 2, summary["batch"]["num_microbatches"])
    events = json.loads((tmp_path / "zbv" / "trace" / "trace.json").read_text())["traceEvents"]
    executed = [e for e in events if e["ph"] == "X" and e["cat"] not in ("wait", "iteration")]
    for rank in (0, 1):
        expected = [str(a) for a in schedule[rank] if a.kind not in (Kind.RECV_ACT, Kind.RECV_GRAD)]
        assert any(name.startswith("W") for name in expected)
        for step in (2, 3):
            mine = sorted((e for e in executed if e["pid"] == rank and e["args"]["step"] == step), key=lambda e: e["ts"])
            assert [e["name"] for e in mine] == expected
    assert summary["trace"]["predicted_iteration_time_s"] > 0
    # ideal: zbv's order at F = B = W per chunk, 6m + p - 1 = 25 steps of which 24 compute (m = 4)
    assert summary["trace"]["ideal_bubble_fraction"] == pytest.approx(1 / 25)
    for png in ("timeline.png", "timeline_predicted.png"):
        assert (tmp_path / "zbv" / "trace" / png).stat().st_size > 0
