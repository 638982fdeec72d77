"""Unit tests run in this process only: starting a subprocess or a multiprocessing process fails
the test (such tests belong in tests/distributed)."""
from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest


class ProcessStarted(AssertionError):
    """A unit test tried to start a process."""


@pytest.fixture(autouse=True)
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise ProcessStarted("tests/unit must not start processes: move this test to tests/distributed")

    # the lowest common points: every subprocess function goes through Popen._execute_child, and
    # multiprocessing, torch.multiprocessing and concurrent.futures through BaseProcess.start
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
