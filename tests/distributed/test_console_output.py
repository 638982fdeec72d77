"""What a run prints when its output goes to a pipe or a log file (a SLURM log, `| tail`): no
progress-bar frames (carriage returns), one whole line per logged step, and units that fit the model
(an MLP's samples have no tokens; its line shows samples/s only)."""
from __future__ import annotations

import json
import re

import pytest

from tests.support.processes import run_cli

MLP = ["model=mlp", "data=synthetic", "model.num_layers=4", "model.hidden_size=16", "train.global_batch_size=8",
       "train.micro_batch_size=2", "parallel.pp=2", "train.steps=6", "train.log_every=2", "train.eval_every=0",
       "train.progress=true", "trace.enabled=false"]
STEP_LINE = re.compile(r"^step +(\d+)/6  loss \S+  lr \S+  step \d+ ms  [\d.]+ samples/s  MFU (\S+)$")


@pytest.mark.slow
def test_piped_output_has_step_lines_and_no_progress_frames(tmp_path):
    done = run_cli("launcher", [*MLP, f"train.run_dir={tmp_path}/run"], tmp_path)
    assert done.code == 0, done.stderr_lines
    assert "\r" not in done.raw_stdout and "\r" not in done.raw_stderr, done.raw_stderr
    assert "train:" not in done.raw_stderr and "it/s" not in done.raw_stderr, done.raw_stderr
    lines = [STEP_LINE.match(line) for line in done.stdout.splitlines() if line.startswith("step ")]
    assert all(lines), done.stdout
    assert [int(m.group(1)) for m in lines] == [2, 4, 6], done.stdout
    assert all(m.group(2) == "n/a" or m.group(2).endswith("%") for m in lines)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["tokens_per_s"] is None and summary["samples_per_s"] > 0   # the key stays, null
