"""pipedream.lifecycle.parent_watch without processes: which parent a process watches (the PID handed
down, torchrun's agent, or none), the check for a parent that died before the signal was armed, and
the PID handed down to children; and the launcher's lines for a killed torchrun and a lost
rendezvous. tests/distributed/test_orphans.py kills real jobs."""
from __future__ import annotations

import os
import signal
import sys

import pytest

from pipedream.lifecycle import parent_watch
from pipedream.lifecycle.parent_watch import (DEATH_SIGNAL, ENV, TORCHRUN_WORKER, death_signal, parent_already_gone,
                                              parent_to_watch, set_death_signal, watch_parent)


def test_the_pid_handed_down_is_the_parent_to_watch():
    assert parent_to_watch({ENV: "4242"}, 77) == 4242
    assert parent_to_watch({ENV: "4242", TORCHRUN_WORKER: "run"}, 77) == 4242


def test_a_torchrun_worker_without_a_pid_watches_its_parent_at_start():
    assert parent_to_watch({TORCHRUN_WORKER: "run"}, 77) == 77   # scripts/launch/*.sh run torchrun directly


def test_a_process_started_by_hand_watches_nothing():
    assert parent_to_watch({}, 77) is None
    assert parent_to_watch({ENV: ""}, 77) is None
    assert parent_to_watch({ENV: "not-a-pid"}, 77) is None


def test_an_adopted_process_knows_its_parent_is_gone():
    assert not parent_already_gone(4242, 4242)
    assert parent_already_gone(4242, 1)      # adopted by init
    assert parent_already_gone(4242, 900)    # or by a subreaper


@pytest.fixture
def recorded(monkeypatch):
    """The signal armed and the end asked for, instead of arming this test process."""
    calls = {"armed": [], "ended": []}
    monkeypatch.setattr(parent_watch, "set_death_signal", lambda signum: calls["armed"].append(signum) or True)
    monkeypatch.setattr(parent_watch, "end_this_process", lambda signum: calls["ended"].append(signum))
    return calls


def test_a_living_parent_is_watched_and_this_pid_handed_down(recorded):
    environ = {ENV: str(os.getppid())}
    assert watch_parent(environ) == os.getppid()
    assert recorded == {"armed": [DEATH_SIGNAL], "ended": []}
    assert environ[ENV] == str(os.getpid())


def test_a_parent_gone_before_the_signal_was_armed_ends_this_process(recorded):
    watch_parent({ENV: str(os.getppid() + 1)})
    assert recorded == {"armed": [DEATH_SIGNAL], "ended": [DEATH_SIGNAL]}


def test_nothing_is_armed_for_a_process_started_by_hand(recorded):
    environ: dict[str, str] = {}
    assert watch_parent(environ) is None
    assert recorded == {"armed": [], "ended": []}
    assert environ[ENV] == str(os.getpid())   # its own children still watch it


def test_without_the_parent_death_signal_nothing_ends(monkeypatch, recorded):
    monkeypatch.setattr(parent_watch, "set_death_signal", lambda signum: False)   # not Linux
    watch_parent({ENV: str(os.getppid() + 1)})
    assert recorded["ended"] == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_the_kernel_keeps_the_signal_armed():
    before = death_signal()
    try:   # a harmless signal: this test process must not die with its parent
        assert set_death_signal(signal.SIGWINCH)
        assert death_signal() == signal.SIGWINCH
    finally:
        set_death_signal(before)
    assert death_signal() == before


def test_a_killed_torchrun_is_one_line_naming_the_signal():
    from launcher.supervise import agent_killed_line

    line = agent_killed_line(4242, signal.SIGKILL)
    assert line.startswith("error: the launch agent (torchrun, pid 4242) was killed by SIGKILL; its ranks were "
                           "stopped: ") and "train.resume=auto" in line and "\n" not in line


def test_a_rendezvous_lost_while_training_is_not_called_a_node_that_never_joined():
    from launcher.agent import lost_rendezvous_line, rendezvous_line

    argv = ["--nnodes=2", "--rdzv-endpoint=10.0.0.1:29500", "--rdzv-conf=join_timeout=300"]
    error = ConnectionError("The connection to the C10d store has failed.\nSee inner exception")
    assert lost_rendezvous_line(error, argv).startswith(
        "error: this node lost the rendezvous at 10.0.0.1:29500 while training (ConnectionError: The connection "
        "to the C10d store has failed.): the node hosting it stopped")
    assert rendezvous_line(error, argv).startswith("error: the 2 nodes did not all join the rendezvous at "
                                                   "10.0.0.1:29500 within launcher.rendezvous_timeout_s=300 ")
