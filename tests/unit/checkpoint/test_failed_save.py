"""A checkpoint phase whose writes fail (a full disk) removes what it half wrote and raises one
CheckpointError naming the folder, the cause and the newest complete checkpoint, which stays."""
from __future__ import annotations

import errno
import json

import pytest

from pipedream.checkpoint.integrity import MARKER, checkpoint_problem, manifest
from pipedream.checkpoint.store import CheckpointError, _written_everywhere


def test_a_failed_commit_leaves_only_complete_checkpoints(tmp_path):
    done = tmp_path / "step_00000001"
    done.mkdir()
    (done / "shard.distcp").write_bytes(bytes(range(256)))
    (done / MARKER).write_text(json.dumps({"step": 1, **manifest(done, MARKER)}))
    half = tmp_path / "step_00000002"   # renamed, its marker not yet written

    def commit():
        half.mkdir()
        (half / "shard.distcp").write_bytes(b"\x01" * 64)
        raise OSError(errno.ENOSPC, "No space left on device", str(half / MARKER))

    with pytest.raises(CheckpointError) as error:
        _written_everywhere(commit, tmp_path, (tmp_path / "step_00000002.partial", half), rank=0)
    line = str(error.value)
    assert line.startswith(f"checkpoint {half} could not be written (rank 0: [Errno 28] No space left on device:")
    assert f"{done} is the newest complete checkpoint (train.resume=auto continues from it)" in line
    assert "\n" not in line and not half.exists() and checkpoint_problem(done) is None


def test_other_errors_are_not_taken_for_a_full_disk(tmp_path):
    def broken():
        raise ValueError("a defect, not a disk")

    with pytest.raises(ValueError):
        _written_everywhere(broken, tmp_path, (tmp_path / "step_00000001.partial",), rank=0)
