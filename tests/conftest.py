"""Two tiers: ``tests/unit`` runs in this process only (fast; ``scripts/test.sh tests/unit``), and
``tests/distributed`` starts processes (Gloo ranks, torchrun, the launcher), so every test there is
marked ``slow`` (``-m "not slow"`` skips them wherever they are collected from). Tests marked
``gpu`` need CUDA and are skipped without it (``scripts/test.sh -m gpu`` on a GPU machine)."""
from __future__ import annotations

from pathlib import Path

import pytest

DISTRIBUTED = Path(__file__).resolve().parent / "distributed"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    cuda = None
    for item in items:
        if DISTRIBUTED in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu"):
            if cuda is None:
                import torch
                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))
