"""SIGKILL one rank of a real torchrun job: torchrun restarts it (launcher.max_restarts), the job
resumes from the last complete checkpoint, and ends with exactly the weights of an uninterrupted run."""
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

from pipedream.export import consolidate
from pipedream.checkpoint.store import complete_checkpoints
from tests.support.checkpoint_harness import train_full
from tests.support.workers import run_workers
from tests.support.training_harness import merge_params

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = ["model=gpt_tiny", "optim=sgd", "train.lr=0.05", "train.global_batch_size=8", "train.micro_batch_size=2",
             "train.steps=100", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1",
             "train.progress=false", "trace.enabled=false", "checkpoint.every=20", "parallel.pp=2"]


def _worker_pid(run_dir: Path, rank: int) -> int | None:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pipedream.train" in cmdline and f"train.run_dir={run_dir}".encode() in cmdline \
                and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    return None


def _steps_logged(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return 0
    lines = metrics.read_text().splitlines()
    return max((json.loads(line)["step"] for line in lines if line.strip()), default=0)


@pytest.mark.slow
def test_sigkill_restarts_from_the_last_checkpoint(tmp_path):
    run_dir = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen([sys.executable, "-m", "launcher", *OVERRIDES, "train.resume=auto",
                            "train.timeout_s=30", "launcher.max_restarts=1", f"train.run_dir={run_dir}"],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while _steps_logged(run_dir) < 30 and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.05)
        victim = _worker_pid(run_dir, rank=1)
        assert victim is not None and _steps_logged(run_dir) < 100, "the job ended before it could be killed"
        os.kill(victim, signal.SIGKILL)
        output, _ = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
    (tmp_path / "job.log").write_text(output)
    assert job.returncode == 0, output[-3000:]
    assert "resume: continuing after step 20" in output, output[-3000:]
    final = complete_checkpoints(run_dir / "checkpoints")[-1]
    assert final.name == "step_00000100"

    expected = merge_params(run_workers(train_full, 2, OVERRIDES, str(tmp_path / "uninterrupted")))
    restored = consolidate(final)
    for name, value in expected.items():
        assert torch.equal(restored[name], value), name
