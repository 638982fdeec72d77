"""No orphans: whatever kills the launcher or torchrun (SIGKILL included, which no handler sees), every
process of the job ends within seconds (pipedream/lifecycle/parent_watch.py), and the run directory
is left as by a crash: the newest complete checkpoint resumes exactly. Two launchers as two nodes:
the node whose launcher dies goes with it, the other one fails at once (a closed connection) in one
line. CPU, Gloo, two processes a job; each test marks its processes with an environment variable of
its own and finds them in /proc/*/environ."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pipedream.checkpoint.store import complete_checkpoints
from tests.support.checkpoint_harness import train_full
from tests.support.workers import run_workers

REPO = Path(__file__).resolve().parents[2]
MARKER = "PIPEDREAM_ORPHANS_TEST"
JOB = ["model=gpt_tiny", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.seq_len=16",
       "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_every=1", "train.eval_every=0",
       "train.eval_batches=1", "train.progress=false", "trace.enabled=false", "parallel.pp=2", "train.timeout_s=60"]
GONE_WITHIN_S = 5
START_S = 180   # two launchers starting torch on two cores


def marked_processes(mark: str) -> dict[int, list[str]]:
    """Live processes (zombies excluded) carrying ``MARKER=mark``: PID -> command line."""
    needle = f"{MARKER}={mark}".encode()
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and needle in (proc / "environ").read_bytes().split(b"\0") and not _zombie(proc):
                found[int(proc.name)] = (proc / "cmdline").read_bytes().decode().split("\0")
        except OSError:   # gone, or not ours
            continue
    return found


def _zombie(proc: Path) -> bool:
    stat = (proc / "stat").read_text()
    return stat[stat.rindex(")") + 2] == "Z"


def ranks(mark: str) -> set[int]:
    return {pid for pid, argv in marked_processes(mark).items()
            if "pipedream.train" in argv and "launcher.agent" not in argv and "launcher" not in argv}


def agent(mark: str) -> int:
    (pid,) = [pid for pid, argv in marked_processes(mark).items() if "launcher.agent" in argv]
    return pid


def launch(mark: str, args: list[str]) -> subprocess.Popen:
    env = {**os.environ, MARKER: mark, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "launcher", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def logged_steps(run_dir: Path) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("}")]


def wait_until(condition, timeout_s: float, what: str, jobs: tuple[subprocess.Popen, ...] = ()) -> None:
    """Polls ``condition`` until true; fails after ``timeout_s`` or when one of ``jobs`` ended."""
    started = time.monotonic()
    while not condition():
        ended = [job.args for job in jobs if job.poll() is not None]
        assert not ended and time.monotonic() - started < timeout_s, f"{what}: not within {timeout_s} s {ended}"
        time.sleep(0.05)


def stop(*jobs: subprocess.Popen) -> None:
    for job in jobs:
        if job.poll() is None:
            job.kill()
        job.communicate()


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:checkpoint .* is unusable")   # a kill during a save: skipped
def test_sigkill_to_the_launcher_ends_every_process_and_the_run_resumes_exactly(tmp_path):
    steps, run_dir, mark = 80, tmp_path / "run", uuid.uuid4().hex
    job_args = [*JOB, "optim=sgd", "train.lr=0.05", f"train.steps={steps}", "checkpoint.every=3"]
    job = launch(mark, [*job_args, f"train.run_dir={run_dir}"])
    try:
        wait_until(lambda: len(logged_steps(run_dir)) >= 7, START_S, "training", (job,))
        os.kill(job.pid, signal.SIGKILL)
        wait_until(lambda: not marked_processes(mark), GONE_WITHIN_S, "every process of the job gone")
    finally:
        stop(job)
    killed_at = logged_steps(run_dir)
    lines_before = len((run_dir / "metrics.jsonl").read_text().splitlines())
    assert killed_at[-1] < steps, "the run finished before the kill"
    newest = complete_checkpoints(run_dir / "checkpoints")[-1]
    resumed_at = int(newest.name.removeprefix("step_"))
    assert 3 <= resumed_at <= killed_at[-1], (newest, killed_at)

    resumed = subprocess.run([sys.executable, "-m", "launcher", *job_args, "train.resume=auto",
                              f"train.run_dir={run_dir}"], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resume: continuing after step {resumed_at}" in resumed.stdout, resumed.stdout[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()[lines_before:]
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == list(range(resumed_at + 1, steps + 1))
    reference = run_workers(train_full, 2, job_args, str(tmp_path / "uninterrupted"))[0]["losses"]
    assert [r["loss"] for r in records] == reference[resumed_at:]   # bit for bit: fp32 on CPU, same layout


@pytest.mark.slow
def test_sigkill_to_torchrun_ends_its_ranks_and_the_launcher_says_so_in_one_line(tmp_path):
    run_dir, mark = tmp_path / "run", uuid.uuid4().hex
    job = launch(mark, [*JOB, "train.steps=100000", "launcher.max_restarts=1", f"train.run_dir={run_dir}"])
    try:
        wait_until(lambda: logged_steps(run_dir) and len(ranks(mark)) == 2, START_S, "training", (job,))
        # a rank torchrun restarts watches torchrun again and trains: kill one, wait for the new pair
        first = ranks(mark)
        os.kill(min(first), signal.SIGKILL)
        wait_until(lambda: not ranks(mark) & first, 30, "torchrun stops the other rank", (job,))
        restarted_at = len(logged_steps(run_dir))
        wait_until(lambda: len(logged_steps(run_dir)) >= restarted_at + 2, 60, "the restarted ranks train", (job,))
        torchrun, restarted = agent(mark), ranks(mark)
        assert len(restarted) == 2 and not restarted & first
        os.kill(torchrun, signal.SIGKILL)
        wait_until(lambda: not ranks(mark), GONE_WITHIN_S, "the ranks gone")
        _, err = job.communicate(timeout=GONE_WITHIN_S + 5)
    finally:
        stop(job)
    assert job.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert error_lines(err) == [f"error: the launch agent (torchrun, pid {torchrun}) was killed by SIGKILL; its ranks "
                                f"were stopped: find what sent the signal (`dmesg` shows the kernel's out-of-memory "
                                f"killer), then continue the run with train.resume=auto"], err[-3000:]
    assert not marked_processes(mark)


@pytest.mark.slow
def test_a_node_whose_launcher_is_killed_goes_and_the_other_node_fails_at_once(tmp_path):
    rendezvous_s, run_dir = 15, tmp_path / "run"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    marks = [uuid.uuid4().hex, uuid.uuid4().hex]
    nodes = [launch(marks[node], [*JOB, "train.steps=100000", "launcher.nnodes=2", f"launcher.node_rank={node}",
                                  f"launcher.master_port={port}", f"launcher.rendezvous_timeout_s={rendezvous_s}",
                                  f"train.run_dir={run_dir}"]) for node in (0, 1)]
    try:
        wait_until(lambda: len(logged_steps(run_dir)) >= 2, START_S, "training", tuple(nodes))
        os.kill(nodes[0].pid, signal.SIGKILL)   # either node may host the rendezvous store here (one machine)
        killed = time.monotonic()
        wait_until(lambda: not marked_processes(marks[0]), GONE_WITHIN_S, "node 0's processes gone")
        _, err = nodes[1].communicate(timeout=rendezvous_s + 10)
        failed_after = time.monotonic() - killed
    finally:
        stop(*nodes)
    assert nodes[1].returncode != 0
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert not marked_processes(marks[1])
    assert failed_after < rendezvous_s + 10
