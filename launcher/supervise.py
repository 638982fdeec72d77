"""Runs torchrun so that stopping the launcher stops the whole job.

torchrun starts in its own session (so a terminal's Ctrl-C reaches it only through here), and every
process it starts carries an environment tag. SIGINT or SIGTERM to the launcher is passed on as
SIGTERM: torchrun relays it to the ranks, which end at once even inside a blocking collective
(SIGINT would raise KeyboardInterrupt only when that call returns). Whatever is still alive after
``grace_s`` seconds, torchrun and ranks alike, is killed. The launcher then exits with 128 + the
signal's number (130 for SIGINT, 143 for SIGTERM). A second signal kills at once.

A ``relayed`` signal (the preemption signal) stops nothing: it is passed on to the ranks, again
every second until the job ends (a rank still starting ignores it), and the job goes on.

SIGKILL cannot be caught: torchrun and every rank watch their own parent instead
(``pipedream.lifecycle.parent_watch``, told the launcher's PID in ``PIPEDREAM_PARENT_PID``) and end
with it. torchrun killed on its own takes its ranks along the same way; the launcher then kills
whatever tagged process is left and reports it in one line, exiting with 128 + the signal.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from pipedream.errors import stderr_line
from pipedream.lifecycle.parent_watch import ENV as PARENT_PID

from launcher.preempt import Relay

TAG = "PIPEDREAM_LAUNCH_ID"   # environment variable every process of one launch inherits
FORWARDED = (signal.SIGINT, signal.SIGTERM)
POLL_S = 0.1


def tagged_processes(tag: str) -> list[int]:
    """Live processes (zombies excluded) whose environment holds ``TAG=tag``."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0") and _state(proc) != "Z":
                found.append(int(proc.name))
        except OSError:  # gone, or not ours
            continue
    return found


def _state(proc: Path) -> str:
    stat = (proc / "stat").read_text()
    return stat[stat.rindex(")") + 2]


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _stop_leftovers(tag: str) -> None:
    """Kills every tagged process still alive and waits (a few seconds at most) until they are gone."""
    deadline = time.monotonic() + 5
    while (leftover := tagged_processes(tag)) and time.monotonic() < deadline:
        _signal_all(leftover, signal.SIGKILL)
        time.sleep(POLL_S)


def agent_killed_line(pid: int, signum: int) -> str:
    name = signal.Signals(signum).name if signum in signal.valid_signals() else f"signal {signum}"
    return (f"error: the launch agent (torchrun, pid {pid}) was killed by {name}; its ranks were stopped: find "
            f"what sent the signal (`dmesg` shows the kernel's out-of-memory killer), then continue the run "
            f"with train.resume=auto")


def _wait_gone(child: subprocess.Popen, tag: str, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if child.poll() is not None and not tagged_processes(tag):
            return True
        time.sleep(POLL_S)
    return False


def run_supervised(command: list[str], grace_s: float, relayed: tuple[int, ...] = ()) -> int:
    """Runs ``command`` to its end and returns its exit code, or stops it on SIGINT/SIGTERM (see module doc)."""
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum)) for sig in FORWARDED}
    relay = Relay()
    previous.update({sig: signal.signal(sig, relay.receive) for sig in relayed})
    tag = uuid.uuid4().hex
    try:
        child = subprocess.Popen(command, start_new_session=True,
                                 env={**os.environ, TAG: tag, PARENT_PID: str(os.getpid())})
        while child.poll() is None and not received:
            relay.pass_on(child.pid)
            time.sleep(POLL_S)
        if received:
            return _stop_job(child, tag, received, grace_s)
        if child.returncode < 0:   # killed: torchrun's own report never came
            _stop_leftovers(tag)   # the ranks end on their own as it dies: this only makes sure
            stderr_line(agent_killed_line(child.pid, -child.returncode))
            return 128 - child.returncode
        return child.returncode
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_job(child: subprocess.Popen, tag: str, received: list[int], grace_s: float) -> int:
    """SIGTERM to torchrun, which relays it to the ranks; SIGKILL to whatever is left after ``grace_s``
    or a second signal. Returns 128 + the first signal's number."""
    signum = received[0]
    name = signal.Signals(signum).name
    print(f"launch: {name} received: stopping the job (up to launcher.grace_s={grace_s:g} s)",
          file=sys.stderr, flush=True)
    _signal_all([-child.pid], signal.SIGTERM)   # torchrun's process group; it relays to the ranks
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and len(received) == 1:
        if _wait_gone(child, tag, min(deadline, time.monotonic() + POLL_S)):
            break
    leftover = tagged_processes(tag)
    if child.poll() is None or leftover:
        print(f"launch: {len(leftover)} process(es) still running: killed", file=sys.stderr, flush=True)
        _signal_all([-child.pid, *leftover], signal.SIGKILL)
        child.wait()
        _wait_gone(child, tag, time.monotonic() + 5)
    return 128 + signum
