"""Expert parallelism's all-to-all hidden behind the schedule (parallel.ep_overlap): dualpipev at
pp=2, dp=2, ep=2 runs each forward with the backward of the other chunk that follows it at the same
time. With the overlap on, training equals the same run with it off and single-process training
(fp32, dropless, sgd), and the trace shows an all-to-all of one micro-batch in flight while another
micro-batch computes on the same rank; with it off, none is. One launch of 4 ranks runs both."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.distributed.test_moe_training import MIXTRAL
from tests.support.training_harness import assert_matches_reference, merge_params, reference_training, train_rank
from tests.support.workers import run_workers

BASE = [*(o for o in MIXTRAL if not o.startswith("parallel.pp")), "train.global_batch_size=16", "parallel.pp=2",
        "parallel.dp=2", "parallel.ep=2", "schedule=dualpipev", "trace.enabled=true", "trace.steps=[2,3]"]
RUNS = {"overlap": ["parallel.ep_overlap=true"], "sequential": ["parallel.ep_overlap=false"]}


def _overlaps(run_dir: Path) -> list[tuple[str, str]]:
    """(all-to-all, compute of another micro-batch) pairs of events whose intervals intersect on one rank."""
    events = [e for e in json.loads((run_dir / "trace" / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    exchanges = [e for e in events if e["cat"] == "all_to_all"]
    compute = [e for e in events if e["cat"] in ("forward", "backward") and "microbatch" in e["args"]]
    assert exchanges and {e["name"].split(" ")[0] for e in exchanges} == {"dispatch", "combine"}
    return [(a["name"], c["name"]) for a in exchanges for c in compute
            if a["pid"] == c["pid"] and a["args"]["microbatch"] != c["args"]["microbatch"]
            and a["ts"] < c["ts"] + c["dur"] and c["ts"] < a["ts"] + a["dur"]]


def test_overlapped_all_to_all_trains_as_sequential_and_single_process(tmp_path):
    runs = [(BASE + extra, str(tmp_path / name)) for name, extra in RUNS.items()]
    per_rank = run_workers(train_rank, 4, runs)
    results = {name: {"params": merge_params([rank_results[index] for rank_results in per_rank]),
                      "losses": per_rank[0][index]["losses"]} for index, name in enumerate(RUNS)}
    overlap, sequential = results["overlap"], results["sequential"]
    assert overlap["losses"] == sequential["losses"]
    assert all(torch.equal(overlap["params"][n], p) for n, p in sequential["params"].items())
    assert_matches_reference(overlap, reference_training(BASE))
    assert _overlaps(tmp_path / "overlap")          # e.g. ("dispatch F3", "B1.1") on one rank
    assert not _overlaps(tmp_path / "sequential")
