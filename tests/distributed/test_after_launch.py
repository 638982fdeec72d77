"""Failures after torchrun started, through the real launcher: the user sees the failing rank's own
cause in one line (a rank killed by SIGKILL is called out of memory), never torchrun's
ChildFailedError traceback nor the survivors' "communication failed"; lines of several ranks stay
whole; a NaN is reported once; a deterministic failure ends the job with exit code 3 instead of
being restarted launcher.max_restarts times; a node that never joins is reported within
launcher.rendezvous_timeout_s."""
from __future__ import annotations

import re
import socket

import pytest

from tests.support.processes import run_cli

JOB = ["model=gpt_tiny", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.seq_len=16",
       "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_every=1", "train.eval_every=0",
       "train.progress=false", "trace.enabled=false", "parallel.pp=2", "launcher.max_restarts=2"]


def rank_starts(done) -> int:
    return sum("pipedream.train" in c and "launcher.agent" not in c and "torchrun" not in c for c in done.commands)


def assert_no_torchrun_noise(lines: list[str]) -> None:
    text = "\n".join(lines)
    assert "Traceback" not in text and "ChildFailedError" not in text, text
    assert all(line.startswith(("error: ", "warning: ")) for line in lines), text


@pytest.mark.slow
def test_a_killed_rank_is_called_out_of_memory(tmp_path):
    done = run_cli("launcher", [*JOB, "train.steps=100000", f"train.run_dir={tmp_path}/run"], tmp_path,
                   fault="1:sigkill:6")
    assert done.launched, "the probe must see torchrun start here"
    errors = [line for line in done.stderr_lines if line.startswith("error: ")]
    assert done.code == 137, done.stderr_lines
    assert errors == ["error: rank 1 was killed by SIGKILL, most likely out of memory (the kernel's OOM killer; "
                      "`dmesg` tells): lower train.micro_batch_size, use more pipeline stages or "
                      "recompute.granularity=full"], done.stderr_lines
    assert_no_torchrun_noise(done.stderr_lines)


@pytest.mark.slow
def test_deterministic_rank_errors_are_whole_lines_and_not_restarted(tmp_path):
    done = run_cli("launcher", [*JOB, "train.steps=100000", f"train.run_dir={tmp_path}/run"], tmp_path,
                   fault="all:raise:4")
    assert done.code == 3, done.stderr_lines
    own = re.compile(r"^error: injected fault on rank [01]: the batch is malformed$")
    assert any(own.match(line) for line in done.stderr_lines), done.stderr_lines
    assert all(own.match(line) for line in done.stderr_lines), "lines run together or a survivor's report shown"
    assert rank_starts(done) == 2, f"restarted: {done.commands}"
    assert_no_torchrun_noise(done.stderr_lines)


@pytest.mark.slow
def test_a_nan_is_reported_once_and_not_restarted(tmp_path):
    done = run_cli("launcher", [*JOB, "train.steps=50", "train.lr=1e12", "train.grad_clip=0",
                                f"train.run_dir={tmp_path}/run"], tmp_path)
    assert done.code == 3, done.stderr_lines
    assert len(done.stderr_lines) == 1 and "nan" in done.stderr_lines[0], done.stderr_lines
    assert rank_starts(done) == 2, f"restarted: {done.commands}"


@pytest.mark.slow
def test_a_node_that_never_joins_is_reported_within_the_rendezvous_timeout(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = run_cli("launcher", [*JOB, "launcher.nnodes=2", "launcher.node_rank=0", f"launcher.master_port={port}",
                                "launcher.rendezvous_timeout_s=3", f"train.run_dir={tmp_path}/run"], tmp_path)
    assert done.code == 1 and len(done.stderr_lines) == 1, done.stderr_lines
    assert done.stderr_lines[0].startswith(f"error: the 2 nodes did not all join the rendezvous at 127.0.0.1:{port} "
                                           f"within launcher.rendezvous_timeout_s=3")
    assert done.seconds < 60
