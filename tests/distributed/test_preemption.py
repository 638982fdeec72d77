"""The preemption signal (SLURM's warning before a time limit): every rank saves a checkpoint at the
same step boundary and stops, the launcher exits with the requeue code, torchrun restarts nothing,
and the next run (train.resume=auto) continues with exactly the losses and weights of an
uninterrupted run. CPU, Gloo, two processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipedream.checkpoint.store import complete_checkpoints
from pipedream.export import consolidate
from pipedream.lifecycle.preemption import read_marker
from tests.support.checkpoint_harness import train_full
from tests.support.preemption_harness import signal_then_resume
from tests.support.training_harness import TINY_GPT, merge_params
from tests.support.workers import run_workers

REPO = Path(__file__).resolve().parents[2]


def test_one_signalled_rank_stops_every_rank_at_the_same_step(tmp_path):
    overrides = [*TINY_GPT, "parallel.pp=2", "train.steps=12", "optim=sgd", "train.lr=0.05", "trace.enabled=false"]
    preempted, reference = tmp_path / "preempted", tmp_path / "reference"
    results = run_workers(signal_then_resume, 2, overrides, str(preempted), str(reference), 1, 7)
    first, left = results[0]["preempted"], results[0]["left"]
    assert first["summary"] == {"preempted_after_step": 7} and len(first["losses"]) == 7
    assert [r["left"]["stops"] for r in results] == [[7], [7]]   # only rank 1 was signalled; both stopped
    assert left["marker"]["step"] == 7 and left["marker"]["signal"] == "USR1" and not left["summary"]
    assert left["checkpoints"] == ["step_00000007"]        # checkpoint.every is 0: the preemption's own
    resumed, expected = results[0]["resumed"], results[0]["reference"]
    assert len(expected["losses"]) == 12
    assert resumed["losses"] == expected["losses"]   # steps 1-7 before the stop, 8-12 after, bit for bit
    assert not (preempted / "preempted.json").exists()   # the resumed run cleared the record
    params = merge_params([r["resumed"] for r in results])
    for name, value in merge_params([r["reference"] for r in results]).items():
        assert torch.equal(params[name], value), name


OVERRIDES = ["model=gpt_tiny", "optim=sgd", "train.lr=0.05", "train.global_batch_size=8", "train.micro_batch_size=2",
             "train.steps=60", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1",
             "train.progress=false", "trace.enabled=false", "parallel.pp=2", "train.timeout_s=60"]


def _logged_steps(run_dir: Path) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    text = metrics.read_text() if metrics.exists() else ""
    return [json.loads(line)["step"] for line in text.splitlines() if line.strip()]


def _launch(run_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "launcher", *OVERRIDES, "train.resume=auto",
                             "launcher.max_restarts=1", f"train.run_dir={run_dir}"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _torchrun_pid(launcher_pid: int) -> int:
    children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == launcher_pid]
    assert len(children) == 1, children
    return children[0]


def _parent(proc: Path) -> int | None:
    try:
        stat = (proc / "stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


@pytest.mark.slow
def test_signal_to_the_launcher_checkpoints_exits_for_requeue_and_resumes_exactly(tmp_path):
    run_dir = tmp_path / "run"
    job = _launch(run_dir)
    try:
        deadline = time.monotonic() + 180
        while len(_logged_steps(run_dir)) < 5:
            assert job.poll() is None and time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.05)
        # as SLURM's --signal does: the job's processes get it, here the launcher and torchrun (which
        # must ignore it); the launcher passes it on to the ranks
        os.kill(_torchrun_pid(job.pid), signal.SIGUSR1)
        os.kill(job.pid, signal.SIGUSR1)
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    (tmp_path / "first.log").write_text(output)
    assert job.returncode == 75, output[-3000:]
    assert "SIGUSR1 received: passed on to the ranks" in output
    stopped = read_marker(run_dir)["step"]
    assert 5 <= stopped < 60, output[-3000:]
    assert [p.name for p in complete_checkpoints(run_dir / "checkpoints")] == [f"step_{stopped:08d}"]
    assert _logged_steps(run_dir) == list(range(1, stopped + 1))   # no torchrun restart ran more steps
    assert "Traceback" not in output, output[-3000:]

    second = _launch(run_dir)
    output, _ = second.communicate(timeout=300)
    assert second.returncode == 0, output[-3000:]
    assert f"resume: continuing after step {stopped}" in output, output[-3000:]
    assert _logged_steps(run_dir) == list(range(1, 61))
    # checkpoint.every is 0: the preemption's checkpoint, then only the finished run's own (checkpoint.at_end)
    assert [p.name for p in complete_checkpoints(run_dir / "checkpoints")] == [f"step_{stopped:08d}", "step_00000060"]

    reference = run_workers(train_full, 2, OVERRIDES, str(tmp_path / "uninterrupted"))
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert losses == reference[0]["losses"]
