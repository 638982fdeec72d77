"""Shared fixtures and the two test tiers: ``tests/unit`` runs in this process only, everything
under ``tests/distributed`` starts processes and is marked ``slow`` here, whatever its file says."""
from __future__ import annotations

from pathlib import Path

import pytest

DISTRIBUTED = Path(__file__).resolve().parent / "distributed"


# torch is imported where it is used: pytest-xdist's controlling process, which runs no test,
# loads this file too
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if DISTRIBUTED in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """One intra-op thread: the tensors are tiny, and several threads per test process only
    contend for the cores with each other and with the worker processes of other tests."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A fresh run directory (train.run_dir) inside the test's temporary directory."""
    path = tmp_path / "run"
    path.mkdir()
    return path


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Ends the Gloo worker pool's processes, where a test started them."""
    import sys

    workers = sys.modules.get("tests.support.workers")
    if workers is not None:
        workers.close_pool()
