"""The unit tier never starts a process: a test that tries fails at once, naming the call (move it
to tests/distributed)."""
from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a unit test started a process ({what}): move it to tests/distributed")
    return refuse


@pytest.fixture(autouse=True)
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("subprocess.Popen"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("multiprocessing start"))
