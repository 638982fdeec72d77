"""Stopping the launcher stops the job: SIGTERM or SIGINT to the launcher's PID alone ends torchrun
and every rank within launcher.grace_s, with exit code 128 + signal and no traceback. Runs the
launcher refuses before torchrun starts: planner-only presets, runs that cannot fit this machine's
memory, and a run directory that holds another run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.__main__ import main as launch

REPO = Path(__file__).resolve().parents[2]
LONG_JOB = ["model=gpt_tiny", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=2",
            "model.seq_len=16", "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=100000",
            "train.log_every=1", "train.eval_every=0", "train.progress=false", "trace.enabled=false"]
GRACE_S = 10


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent PID, state) of a process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), fields[0]


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and (stat := _stat(int(proc.name))) is not None:
            children.setdefault(stat[0], []).append(int(proc.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[1] != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signal_to_the_launcher_stops_every_process(tmp_path, sig, code):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen([sys.executable, "-m", "launcher", *LONG_JOB, f"train.run_dir={run_dir}",
                            f"launcher.grace_s={GRACE_S}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text():
            assert job.poll() is None and time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.1)
        processes = descendants(job.pid)
        assert len(processes) >= 3, processes   # torchrun and two ranks
        os.kill(job.pid, sig)
        signalled = time.monotonic()
        _, err = job.communicate(timeout=GRACE_S + 15)
        while any(alive(pid) for pid in processes) and time.monotonic() < signalled + GRACE_S + 5:
            time.sleep(0.1)
        took = time.monotonic() - signalled
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == code, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert f"{signal.Signals(sig).name} received" in err
    assert not [pid for pid in processes if alive(pid)]
    assert took < GRACE_S


@pytest.mark.slow
def test_processes_that_ignore_sigterm_are_killed_after_the_grace_period(tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text("import signal, subprocess, sys, time\n"
                      "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "if sys.argv[1:] != ['child']:\n"
                      "    subprocess.Popen([sys.executable, __file__, 'child'], start_new_session=True)\n"
                      "time.sleep(120)\n")
    supervisor = ("import sys; from launcher.supervise import run_supervised; "
                  f"sys.exit(run_supervised([sys.executable, {str(script)!r}], grace_s=1.0))")
    job = subprocess.Popen([sys.executable, "-c", supervisor], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while len(descendants(job.pid)) < 2:
            assert time.monotonic() < deadline, "the stubborn processes did not start"
            time.sleep(0.1)
        processes = descendants(job.pid)
        os.kill(job.pid, signal.SIGTERM)
        signalled = time.monotonic()
        _, err = job.communicate(timeout=15)
        while any(alive(pid) for pid in processes) and time.monotonic() < signalled + 10:
            time.sleep(0.1)
        took = time.monotonic() - signalled
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 143, err
    assert "still running: killed" in err
    assert not [pid for pid in processes if alive(pid)]
    assert 1.0 <= took < 5


def test_planner_only_preset_is_refused_before_torchrun():
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "launcher", "model=gpt_1.7b"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: model=gpt_1.7b is planner-only"), err
    assert "launch:" not in result.stdout
    assert time.monotonic() - started < 15


@pytest.fixture
def no_torchrun(monkeypatch):
    """Records the commands the launcher would run instead of running them."""
    ran: list[list[str]] = []
    monkeypatch.setattr("launcher.__main__.run_supervised", lambda command, grace_s, *_: ran.append(command) or 0)
    return ran


def test_run_that_cannot_fit_memory_is_refused(capsys, no_torchrun, tmp_path):
    big = ["model.num_layers=24", "model.hidden_size=2304", "model.num_heads=24", "model.seq_len=2048",
           "model.vocab_size=51200", f"train.run_dir={tmp_path}"]
    assert launch(big) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs about" in err and "weights 6.6, gradients 6.6" in err, err
    assert no_torchrun == []
    assert launch(big + ["launcher.check_memory=false"]) == 0 and len(no_torchrun) == 1


def test_reused_run_dir_is_refused_unless_resumed_or_overwritten(capsys, no_torchrun, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert launch([f"train.run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: train.run_dir={run_dir} already holds"), err
    assert no_torchrun == []
    assert launch([f"train.run_dir={run_dir}", "train.resume=auto"]) == 0
    assert (run_dir / "metrics.jsonl").exists()
    assert launch([f"train.run_dir={run_dir}", "train.overwrite=true"]) == 0
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
    assert len(no_torchrun) == 2 and "train.overwrite=true" in no_torchrun[1]
