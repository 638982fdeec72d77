"""Runs a command line of this project with tests/support/process_probe on PYTHONPATH: every Python process it
starts logs its command line (so a test sees whether torchrun or a rank started), and a training rank
can be told to inject a fault (see tests/support/process_probe/sitecustomize.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).resolve().parent / "process_probe"
LAUNCHED = ("launcher.agent", "torchrun", "pipedream.train")   # what "torchrun started" looks like
MODULES = {"launcher": "launcher", "planner": "planner", "export": "pipedream.export"}


@dataclass(frozen=True)
class Finished:
    code: int
    stdout: str
    stderr_lines: list[str]     # non-blank
    seconds: float
    commands: list[str]         # every Python process started, the command itself first
    raw_stdout: str = ""        # as written: carriage returns kept (stdout above has them as newlines)
    raw_stderr: str = ""

    @property
    def launched(self) -> list[str]:
        return [c for c in self.commands if any(marker in c for marker in LAUNCHED)]


def run_cli(tool: str, argv: list[str], log_dir: Path, fault: str | None = None, timeout: float = 240) -> Finished:
    log = log_dir / f"probe-{time.monotonic_ns()}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PROBE_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(PROBE), str(REPO), os.environ.get("PYTHONPATH", "")])}
    if fault:
        env["PROBE_FAULT"] = fault
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", MODULES[tool], *argv], cwd=REPO, env=env, capture_output=True,
                          timeout=timeout)
    raw_stdout, raw_stderr = (b.decode("utf-8", errors="replace") for b in (done.stdout, done.stderr))
    stdout, stderr = (t.replace("\r\n", "\n").replace("\r", "\n") for t in (raw_stdout, raw_stderr))
    seconds = time.monotonic() - started
    commands = log.read_text().splitlines() if log.exists() else []
    return Finished(done.returncode, stdout, [l for l in stderr.splitlines() if l.strip()], seconds, commands,
                    raw_stdout, raw_stderr)
