"""A checkpoint's torch files are read as data: each rank's RNG file and an export's consolidated state
load with the weights-only unpickler, and one carrying a pickled callable is refused in one line
before it can run."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from pipedream.checkpoint.integrity import manifest
from pipedream.checkpoint.plain import NotPlainFileError, load_plain
from pipedream.checkpoint.store import (MARKER, complete_checkpoints, layers_module, load_checkpoint, load_verified,
                                        rng_state, save_checkpoint, step_dir)
from tests.support.single_process import world_of_one as one_rank_world


class RunsCode:
    """Unpickling it would create ``marker``: proof that pickled code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def poisoned(path: Path, marker: Path) -> Path:
    torch.save({"layout": "layout", "rng": {"torch": RunsCode(marker)}}, path)
    return path


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    with one_rank_world():
        yield


def test_rng_file_round_trips_as_plain_data(tmp_path):
    path = tmp_path / "rank0.pt"
    state = {"layout": "pp2-dp1-tp1-v1-1f1b-[0, 2, 4]", "rng": rng_state()}
    torch.save(state, path)
    loaded = load_plain(path)
    assert loaded["layout"] == state["layout"] and torch.equal(loaded["rng"]["torch"], state["rng"]["torch"])


def test_pickled_code_is_refused_in_one_line_without_running(tmp_path):
    marker = tmp_path / "ran"
    path = poisoned(tmp_path / "rank0.pt", marker)
    with pytest.raises(NotPlainFileError) as refused:
        load_plain(path)
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and "not a plain checkpoint file" in message
    assert "weights_only=False" not in message   # torch's own advice is exactly what must not be followed
    assert not marker.exists()


def test_load_checkpoint_refuses_the_rng_file_before_loading_anything(tmp_path):
    marker = tmp_path / "ran"
    folder = tmp_path / "step_00000001"
    folder.mkdir()
    poisoned(folder / "rank0.pt", marker)
    module = layers_module({0: nn.Linear(4, 4)})
    before = {k: v.clone() for k, v in module.state_dict().items()}
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(NotPlainFileError, match="rank0.pt is not a plain checkpoint file"):
        load_checkpoint(folder, module, optimizer, scheduler, "layout", rank=0)
    assert not marker.exists()
    assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items())


def test_resume_falls_back_past_a_poisoned_rng_file_with_one_warning(tmp_path, capsys):
    """Even with its marker rewritten to match (so the checksums pass), the newest checkpoint is refused."""
    torch.manual_seed(0)
    module = layers_module({0: nn.Linear(8, 8)})
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for step in (1, 2):
        save_checkpoint(tmp_path, step, module, optimizer, "layout", {"step": step}, rank=0, keep=2)
    newest, marker = step_dir(tmp_path, 2), tmp_path / "ran"
    poisoned(newest / "rank0.pt", marker)
    (newest / MARKER).write_text(json.dumps({"step": 2, **manifest(newest, MARKER)}))
    capsys.readouterr()
    path, step = load_verified(complete_checkpoints(tmp_path), module, optimizer, scheduler, "layout", rank=0)
    assert (path.name, step) == ("step_00000001", 1)
    assert not marker.exists()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(warnings) == 1 and "rank0.pt is not a plain checkpoint file" in warnings[0], warnings
