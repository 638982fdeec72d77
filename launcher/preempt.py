"""The launcher's part in preemption (``pipedream.lifecycle.preemption``): torchrun ignores the signal, the
launcher passes it on to the ranks without stopping anything, and a run the ranks stopped for
preemption ends the launcher with ``preemption.requeue_exit_code``.

torchrun (``launcher.agent``) ignores the signal, so the ranks it starts begin with it ignored until
their handler is installed; a signal sent in that window is lost, which is why the relay repeats it
every ``REPEAT_S`` seconds until the job ends (a rank's handler only sets a flag, so repeats are
harmless). The ranks are torchrun's child processes.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from pipedream.errors import stderr_line
from pipedream.config.preemption import PreemptionSpec
from pipedream.lifecycle.preemption import read_marker

REPEAT_S = 1.0


def child_processes(parent: int) -> list[int]:
    """Live direct children of ``parent``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == parent and fields[0] != "Z":
            found.append(int(proc.name))
    return found


class Relay:
    """Signal handler (``receive``) plus the supervisor loop's part (``pass_on``)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.sent_at: float | None = None

    def receive(self, signum: int, _frame: Any) -> None:
        if self.signum is None:
            stderr_line(f"launch: {signal.Signals(signum).name} received: passed on to the ranks, which save a "
                        f"checkpoint at the next step boundary and stop")
        self.signum = signum

    def pass_on(self, agent_pid: int) -> None:
        if self.signum is None or (self.sent_at is not None and time.monotonic() - self.sent_at < REPEAT_S):
            return
        self.sent_at = time.monotonic()
        for pid in child_processes(agent_pid):
            try:
                os.kill(pid, self.signum)
            except OSError:   # already gone
                pass


def agent_options(spec: PreemptionSpec) -> list[str]:
    """``launcher.agent``'s options: torchrun ignores the preemption signal."""
    return [f"--ignore-signal={spec.signal_name}"] if spec.signal_name else []


def relayed_signals(spec: PreemptionSpec) -> tuple[int, ...]:
    return (spec.signal,) if spec.signal is not None else ()


def job_exit_code(code: int, run_dir: Path, spec: PreemptionSpec) -> int:
    """torchrun's exit code, or the requeue code where the ranks stopped for preemption (they end with
    0 then, so that torchrun does not restart them)."""
    if code == 0 and spec.signal is not None and (record := read_marker(run_dir)) is not None:
        stderr_line(f"launch: stopped for preemption after step {record.get('step')}; exit code "
                    f"{spec.requeue_exit_code} asks for a requeue")
        return spec.requeue_exit_code
    return code
