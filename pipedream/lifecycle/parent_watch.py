"""A process of a job ends when the process that started it dies, whatever killed that one (SIGKILL
included, which no handler sees).

Each process arms this itself, first thing: torchrun's agent (``launcher.agent``, started by the
launcher) and every rank (``pipedream.train``, started by the agent). Linux's parent-death signal
(``prctl(PR_SET_PDEATHSIG)``) then kills it the moment its parent exits; nothing keeps running and
writing into the run directory, and a rank ends as in a crash (the newest committed checkpoint
stays, a half-written one is skipped on resume). A parent that died before the child armed the
signal is caught by comparing ``os.getppid()`` with the PID the parent handed down in
``PIPEDREAM_PARENT_PID``: an orphan has been adopted by another process.

The signal fires when the parent's *thread* that started the child exits: the launcher and torchrun
start their children from their main thread, which lives as long as they do. Ranks that torchrun
restarts (``launcher.max_restarts``) arm it again, against the same agent. A rank started by a bare
``torchrun`` (``scripts/launch/*.sh``) has no PID handed down: its parent at start is torchrun's agent.
A process started by hand (no PID handed down, not under torchrun) watches nothing.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import MutableMapping

ENV = "PIPEDREAM_PARENT_PID"      # the PID of the process that started this one
TORCHRUN_WORKER = "TORCHELASTIC_RUN_ID"   # set by torchrun in every worker's environment
DEATH_SIGNAL = signal.SIGKILL     # as a crash: no handler can delay it (a blocked collective, a store wait)
PR_SET_PDEATHSIG, PR_GET_PDEATHSIG = 1, 2


def parent_to_watch(environ: MutableMapping[str, str], parent_now: int) -> int | None:
    """The PID this process's parent should have: the one handed down, else (a torchrun worker) the
    parent now; None where this process was started by hand."""
    handed_down = environ.get(ENV, "").strip()
    if handed_down.isdigit():
        return int(handed_down)
    return parent_now if TORCHRUN_WORKER in environ else None


def parent_already_gone(expected: int, parent_now: int) -> bool:
    """An orphan is adopted (by init or a subreaper) as soon as its parent dies: its parent PID changes."""
    return parent_now != expected


def set_death_signal(signum: int) -> bool:
    """Asks the kernel to send ``signum`` to this process when its parent exits (0 clears it).
    False where that is not available (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def death_signal() -> int:
    """The parent-death signal armed now (0: none); Linux only."""
    value = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    return value.value


def end_this_process(signum: int) -> None:
    os.kill(os.getpid(), signum)


def watch_parent(environ: MutableMapping[str, str] = os.environ) -> int | None:
    """Arms the parent-death signal against the parent this process should have (ending at once if
    that one is already gone), then hands this PID down to the processes this one starts. Returns
    the parent watched, None when none is."""
    parent = parent_to_watch(environ, os.getppid())
    if parent is not None and set_death_signal(DEATH_SIGNAL) and parent_already_gone(parent, os.getppid()):
        end_this_process(DEATH_SIGNAL)
    environ[ENV] = str(os.getpid())
    return parent
