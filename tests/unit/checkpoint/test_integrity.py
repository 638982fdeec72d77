"""Checkpoint integrity in one process (a Gloo world of 1): content checksums in the marker, fallback
to the previous complete checkpoint on a flipped bit, a zero-filled shard or a corrupt .metadata,
old size-only markers, and leftovers removed at the next prune."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from pipedream.checkpoint.store import (MARKER, CheckpointError, complete_checkpoints, layers_module, load_verified,
                                  save_checkpoint, step_dir)
from pipedream.checkpoint.integrity import CHUNK, crc32_of
from tests.support.single_process import world_of_one as one_rank_world


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    with one_rank_world():
        yield


class Trained:
    """A two-layer model whose weights after ``step`` optimizer steps are known."""

    def __init__(self):
        torch.manual_seed(0)
        self.module = layers_module({0: nn.Linear(64, 64), 1: nn.Linear(64, 8)})
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)

    def step(self) -> None:
        self.optimizer.zero_grad()
        self.module.layers["1"](self.module.layers["0"](torch.ones(4, 64))).square().sum().backward()
        self.optimizer.step()

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.module.state_dict().items()}


def save_three(root: Path) -> tuple[Trained, dict[int, dict[str, torch.Tensor]]]:
    """Checkpoints after steps 1, 2, 3 (keep=3); returns the weights at each."""
    model, weights = Trained(), {}
    for step in (1, 2, 3):
        model.step()
        save_checkpoint(root, step, model.module, model.optimizer, "layout", {"step": step}, rank=0, keep=3)
        weights[step] = model.weights()
    return model, weights


def load_newest(root: Path) -> tuple[Path, int, Trained]:
    fresh = Trained()
    path, step = load_verified(complete_checkpoints(root), fresh.module, fresh.optimizer, fresh.scheduler,
                               "layout", rank=0)
    return path, step, fresh


def largest_shard(path: Path) -> Path:
    return max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)


def test_marker_records_a_checksum_per_file(tmp_path):
    save_three(tmp_path)
    folder = step_dir(tmp_path, 3)
    marker = json.loads((folder / MARKER).read_text())
    names = {p.name for p in folder.iterdir()} - {MARKER}
    assert set(marker["crc32"]) == set(marker["files"]) == names
    assert all(marker["crc32"][n] == crc32_of(folder / n) for n in names)


def test_intact_checkpoint_loads_the_newest(tmp_path, capsys):
    _, weights = save_three(tmp_path)
    path, step, fresh = load_newest(tmp_path)
    assert (path.name, step) == ("step_00000003", 3)
    assert all(torch.equal(fresh.weights()[k], v) for k, v in weights[3].items())
    assert "warning" not in capsys.readouterr().err


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["bit_flip", "zero_filled_shard", "corrupt_metadata"])
def test_damaged_checkpoint_falls_back_with_one_warning(tmp_path, capsys, damage):
    _, weights = save_three(tmp_path)
    newest = step_dir(tmp_path, 3)
    if damage == "bit_flip":
        victim = largest_shard(newest)
        flip_a_bit(victim)
    elif damage == "zero_filled_shard":
        victim = largest_shard(newest)
        victim.write_bytes(bytes(victim.stat().st_size))
    else:
        victim = newest / ".metadata"
        victim.write_bytes(b"\x00garbage" * (victim.stat().st_size // 8) + b"x" * (victim.stat().st_size % 8))
    assert [p.name for p in complete_checkpoints(tmp_path)][-1] == "step_00000003"   # the sizes still match
    path, step, fresh = load_newest(tmp_path)
    assert (path.name, step) == ("step_00000002", 2)
    assert all(torch.equal(fresh.weights()[k], v) for k, v in weights[2].items())
    warnings = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(warnings) == 1 and warnings[0].startswith("warning:") and victim.name in warnings[0], warnings
    assert "step_00000002" in warnings[0]


def test_unreadable_file_without_checksums_falls_back(tmp_path, capsys):
    """Old markers (sizes only) still load; a .metadata that fails to load is skipped, not a traceback."""
    save_three(tmp_path)
    for step in (2, 3):
        marker = step_dir(tmp_path, step) / MARKER
        recorded = json.loads(marker.read_text())
        del recorded["crc32"]
        marker.write_text(json.dumps(recorded))
    metadata = step_dir(tmp_path, 3) / ".metadata"
    metadata.write_bytes(bytes(metadata.stat().st_size))
    path, step, _ = load_newest(tmp_path)
    assert step == 2
    err = capsys.readouterr().err
    assert "step_00000003" in err and "loading failed" in err
    assert "no content checksums" in err and "Traceback" not in err


def test_no_good_checkpoint_left_is_one_line_error(tmp_path, capsys):
    save_three(tmp_path)
    for step in (1, 2, 3):
        flip_a_bit(largest_shard(step_dir(tmp_path, step)))
    with pytest.raises(CheckpointError) as error:
        load_newest(tmp_path)
    assert "\n" not in str(error.value) and "no usable checkpoint" in str(error.value)
    assert len(capsys.readouterr().err.strip().splitlines()) == 3


def test_half_deleted_checkpoints_go_at_the_next_prune(tmp_path):
    model, _ = save_three(tmp_path)
    half = step_dir(tmp_path, 1)
    for shard in half.glob("*.distcp"):
        shard.unlink()        # a prune killed midway: marker left, shards gone
    stale = tmp_path / "step_00000002.partial"
    stale.mkdir()             # a save killed midway
    with pytest.warns(UserWarning, match="missing or truncated"):
        model.step()
        save_checkpoint(tmp_path, 4, model.module, model.optimizer, "layout", {}, rank=0, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]


def test_streamed_checksum_equals_the_whole_file_crc(tmp_path):
    """Streaming in chunks (several here) gives the CRC-32 of the whole file."""
    import zlib
    blob = tmp_path / "blob"
    data = bytes(range(256)) * (10 * 1024)
    blob.write_bytes(data)
    assert crc32_of(blob) == f"{zlib.crc32(data):08x}" and len(data) > 2 * CHUNK
