"""Elastic jobs on one machine: each "node" is a launcher of its own on one rendezvous port, its
processes marked with an environment variable so that a test can SIGKILL a whole node (launcher,
agent and rank) as a lost machine goes. The first node is started first and hosts the rendezvous
store (as a cluster's master_addr node does): the nodes that come and go are the others."""
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
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MARKER = "PIPEDREAM_ELASTIC_TEST"
JOB = ["model=gpt_tiny", "model.num_layers=4", "model.hidden_size=32", "model.num_heads=2", "model.seq_len=16",
       "optim=sgd", "train.lr=0.05", "train.warmup_steps=2", "train.global_batch_size=8", "train.micro_batch_size=2",
       "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "train.progress=false",
       "trace.enabled=false", "train.timeout_s=30", "checkpoint.every=5"]
ELASTIC = ["launcher.nnodes=2", "launcher.min_nodes=1", "launcher.max_restarts=4", "launcher.last_call_s=1",
           "launcher.rendezvous_timeout_s=300"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def port_listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def marked_pids(mark: str) -> list[int]:
    needle = f"{MARKER}={mark}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and needle in (proc / "environ").read_bytes().split(b"\0"):
                stat = (proc / "stat").read_text()
                if stat[stat.rindex(")") + 2] != "Z":
                    found.append(int(proc.name))
        except OSError:   # gone, or not ours
            continue
    return found


def records(run_dir: Path) -> list[dict[str, Any]]:
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def last_step(run_dir: Path) -> int:
    return max((r["step"] for r in records(run_dir)), default=0)


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


class ElasticJob:
    """Launchers of one elastic job, one per node, started and killed at will."""

    def __init__(self, tmp_path: Path, overrides: list[str], nnodes: int = 2):
        self.tmp_path, self.port = tmp_path, free_port()
        self.run_dir = tmp_path / "run"
        self.args = [*JOB, *ELASTIC, *overrides, f"launcher.master_port={self.port}", f"train.run_dir={self.run_dir}"]
        self.nodes: dict[int, tuple[subprocess.Popen, str, Path]] = {}

    def start(self, node: int) -> None:
        mark = uuid.uuid4().hex
        log = self.tmp_path / f"node{node}-{mark[:6]}.log"
        env = {**os.environ, MARKER: mark, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with log.open("w") as out:
            job = subprocess.Popen([sys.executable, "-m", "launcher", *self.args, f"launcher.node_rank={node}"],
                                   cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        self.nodes[node] = (job, mark, log)
        if node == 0:   # the rendezvous store is up before any other node may host it
            wait_until(lambda: port_listening(self.port) or job.poll() is not None, 120, "node 0's rendezvous")

    def kill(self, node: int) -> float:
        """SIGKILLs every process of ``node`` (a lost machine); returns when it was done."""
        job, mark, _ = self.nodes[node]
        killed_at = time.time()
        _kill_marked(mark)
        job.wait(timeout=10)
        wait_until(lambda: not marked_pids(mark), 10, f"node {node}'s processes gone")
        return killed_at

    def lose_node_after(self, step: int) -> float:
        """Starts both nodes, SIGKILLs the second after ``step``, waits for the first to finish alone
        (it must succeed); returns when the node was killed. Every process goes in the end."""
        try:
            self.start(0)
            self.start(1)
            wait_until(lambda: last_step(self.run_dir) >= step, 180, f"step {step}")
            killed_at = self.kill(1)
            assert self.wait(0) == 0, self.output(0)[-3000:]
        finally:
            self.stop()
        return killed_at

    def wait(self, node: int, timeout_s: float = 600) -> int:
        return self.nodes[node][0].wait(timeout=timeout_s)

    def output(self, node: int) -> str:
        return self.nodes[node][2].read_text()

    def stop(self) -> None:
        for node in list(self.nodes):
            job, mark, _ = self.nodes[node]
            _kill_marked(mark)
            job.wait(timeout=10)

    def summary(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "summary.json").read_text())


def _kill_marked(mark: str) -> None:
    for pid in marked_pids(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:   # gone already
            pass


def reference_run(tmp_path: Path, overrides: list[str], name: str = "reference") -> dict[str, Any]:
    """The same job on one node, never interrupted: its summary and its losses by step."""
    run_dir = tmp_path / name
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "launcher", *JOB, *overrides, f"train.run_dir={run_dir}",
                           f"launcher.master_port={free_port()}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"summary": json.loads((run_dir / "summary.json").read_text()),
            "losses": {r["step"]: r["loss"] for r in records(run_dir)}}
