"""Elastic recovery on this machine: a 2-node localhost job (two launchers, one process each, pp=2,
checkpoint.every=5) whose second node is SIGKILLed (launcher, agent and rank) after a random step,
several times; each time the first node re-forms alone as pp=1 and finishes. Reports, per failure,
the time from the kill to the first step completed after it (detection, rendezvous, re-plan, worker
start, reshard, first step) and the steps done again. Writes docs/bench_elastic.json and its section
of docs/benchmarks.md. Run: .venv/bin/python -m scripts.bench.elastic [--failures 5] [--seed 0]"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from scripts.bench.runtime_report import machine, replace_section
from tests.support.elastic_harness import ElasticJob, last_step, wait_until

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY = 40, 5


def one_failure(tmp: Path, kill_after: int) -> dict[str, Any]:
    job = ElasticJob(tmp, ["parallel.pp=2", f"train.steps={STEPS}", f"checkpoint.every={EVERY}"])
    try:
        job.start(0)
        job.start(1)
        wait_until(lambda: last_step(job.run_dir) >= kill_after, 300, f"step {kill_after}")
        killed_at = job.kill(1)
        code = job.wait(0, 300)
        if code != 0:
            raise RuntimeError(f"node 0 ended with {code}: {job.output(0)[-2000:]}")
    finally:
        job.stop()
    recovery = job.summary()["recoveries"][0]
    return {"killed_after_step": recovery["interrupted_after_step"], "resumed_after_step": recovery["resumed_after_step"],
            "steps_redone": recovery["steps_redone"], "seconds_from_kill": recovery["first_step_at"] - killed_at,
            "seconds_from_detection": recovery["seconds"],
            "rendezvous_and_start_s": recovery["restarted_at"] - recovery["detected_at"]}


def markdown(data: dict[str, Any]) -> str:
    runs = data["runs"]
    from_kill = [r["seconds_from_kill"] for r in runs]
    redone = [r["steps_redone"] for r in runs]
    lines = ["## Elastic recovery: a node lost in a 2-node localhost job", "",
             f"Written by `scripts/bench/elastic.py` on {data['date']} ({data['machine'].get('cpu', '?')}, "
             f"{data['machine'].get('cores', '?')} cores, shared). Two launchers on one machine as two nodes "
             f"(`launcher.nnodes=2 launcher.min_nodes=1 launcher.last_call_s=1`), one process each, gpt_tiny "
             f"(4 layers, hidden 32), pp=2, `checkpoint.every={EVERY}`, {STEPS} steps; the second node (its "
             f"launcher, agent and rank) is SIGKILLed after a random step; the first re-forms alone as pp=1 and "
             f"finishes. Recovery: from the kill to the first step completed after it.", "",
             f"Over {len(runs)} failures: recovery **median {statistics.median(from_kill):.1f} s, max "
             f"{max(from_kill):.1f} s**; steps done again median {statistics.median(redone):g}, max {max(redone)}.", "",
             "| killed after step | resumed after step | steps redone | kill -> first step (s) | "
             "detection -> re-formed start (s) |", "| --- | --- | --- | --- | --- |"]
    for r in runs:
        lines.append(f"| {r['killed_after_step']} | {r['resumed_after_step']} | {r['steps_redone']} | "
                     f"{r['seconds_from_kill']:.1f} | {r['rendezvous_and_start_s']:.1f} |")
    lines += ["", "Nearly all of a recovery lies between the survivor's detection (within milliseconds of the kill: "
              "the closed socket fails its next exchange) and the re-formed rank's start (last column, measured up to "
              "the end of its checkpoint load): the rank's exit, the rendezvous (the lost node's heartbeat expiring, "
              "3 x 1 s, then `launcher.last_call_s`), a new rank process starting Python and torch, composing the "
              "config, re-planning, building the model and loading the checkpoint; its spread follows the load of "
              "this shared machine. The steps redone are those since the last checkpoint (`checkpoint.in_memory_every` "
              "removes them: docs/reliability.md)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failures", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "docs")
    parser.add_argument("--report-only", action="store_true", help="rewrite the section from bench_elastic.json")
    args = parser.parse_args()
    if args.report_only:
        data = json.loads((args.out_dir / "bench_elastic.json").read_text())
        replace_section(args.out_dir / "benchmarks.md", "bench_elastic", markdown(data))
        return
    chooser = random.Random(args.seed)
    runs = []
    for index in range(args.failures):
        kill_after = chooser.randint(6, STEPS - 10)
        with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
            runs.append(one_failure(Path(tmp), kill_after))
        print(json.dumps(runs[-1]), flush=True)
    data = {"date": datetime.date.today().isoformat(), "machine": machine(), "steps": STEPS, "every": EVERY,
            "runs": runs}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "bench_elastic.json").write_text(json.dumps(data, indent=1) + "\n")
    print(markdown(data))
    replace_section(args.out_dir / "benchmarks.md", "bench_elastic", markdown(data))


if __name__ == "__main__":
    main()
