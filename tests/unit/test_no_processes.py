"""The unit tier's guard (tests/unit/conftest.py) refuses every way of starting a process."""
from __future__ import annotations

import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing

from tests import conftest


def test_subprocess_is_refused():
    with pytest.raises(AssertionError, match="must not start processes"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(AssertionError, match="must not start processes"):
        subprocess.Popen(["true"])


@pytest.mark.parametrize("context", [multiprocessing.get_context("spawn"), torch.multiprocessing.get_context("fork")])
def test_multiprocessing_is_refused(context):
    process = context.Process(target=print)
    with pytest.raises(AssertionError, match="must not start processes"):
        process.start()
    assert process.pid is None


class _Item:
    """What the collection hook reads and writes on a test item."""

    def __init__(self, path: Path, *marks: str):
        self.path = path
        self.marks = [getattr(pytest.mark, name) for name in marks]

    def add_marker(self, mark) -> None:
        self.marks.append(mark)

    def get_closest_marker(self, name: str):
        return next((m for m in self.marks if m.name == name), None)


def test_the_distributed_directory_is_slow_and_gpu_tests_need_cuda():
    tests = Path(conftest.__file__).parent
    distributed, unit, gpu = (_Item(tests / "distributed" / "test_x.py"), _Item(tests / "unit" / "test_x.py"),
                              _Item(tests / "unit" / "test_y.py", "gpu"))
    conftest.pytest_collection_modifyitems(None, [distributed, unit, gpu])
    assert distributed.get_closest_marker("slow") is not None
    assert unit.get_closest_marker("slow") is None and gpu.get_closest_marker("slow") is None
    assert (gpu.get_closest_marker("skip") is None) == torch.cuda.is_available()
    assert unit.get_closest_marker("skip") is None
