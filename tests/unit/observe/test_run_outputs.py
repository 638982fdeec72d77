"""A run directory holding another run's outputs is refused unless resumed or overwritten."""
from __future__ import annotations

import pytest

from pipedream.errors import ConfigError
from pipedream.observe.run_outputs import claim_run_dir
from pipedream.config.run_spec import build_run_spec
from tests.support.training_harness import compose_config


def old_run(run_dir):
    (run_dir / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "summary.json").write_text("{}")
    (run_dir / "notes.txt").write_text("mine")
    return run_dir


def claim(run_dir, *overrides):
    claim_run_dir(build_run_spec(compose_config([f"train.run_dir={run_dir}", *overrides])), run_dir)


def test_fresh_or_empty_directory_is_fine(tmp_path):
    claim(tmp_path / "new")
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    claim(tmp_path / "empty")


def test_reused_directory_is_refused_in_one_line(tmp_path):
    run_dir = old_run(tmp_path / "run")
    with pytest.raises(ConfigError) as error:
        claim(run_dir)
    message = str(error.value)
    assert "\n" not in message and f"train.run_dir={run_dir}" in message
    assert "metrics.jsonl" in message and "train.resume=auto" in message and "train.overwrite=true" in message
    assert (run_dir / "metrics.jsonl").exists()


def test_resume_keeps_and_overwrite_clears_the_old_outputs(tmp_path):
    run_dir = old_run(tmp_path / "run")
    claim(run_dir, "train.resume=auto")
    assert (run_dir / "checkpoints" / "step_00000002").exists()
    claim(run_dir, "train.overwrite=true")
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]   # only run outputs go
    with pytest.raises(ConfigError, match="contradict"):
        claim(run_dir, "train.overwrite=true", "train.resume=auto")


def test_separate_checkpoint_dir_counts(tmp_path):
    shared = tmp_path / "ckpt"
    (shared / "step_00000004").mkdir(parents=True)
    with pytest.raises(ConfigError, match="step_00000004"):
        claim(tmp_path / "run", f"checkpoint.dir={shared}")
    claim(tmp_path / "run", f"checkpoint.dir={shared}", "train.overwrite=true")
    assert not any(shared.iterdir())


def test_training_entry_refuses_a_reused_run_dir_before_any_process_group(tmp_path, capsys, monkeypatch):
    """Plain torchrun users get the same refusal, from rank 0, before the process group starts."""
    import torch.distributed as dist

    from pipedream.train import run
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run_dir = old_run(tmp_path / "run")
    assert run(compose_config([f"train.run_dir={run_dir}", "parallel.pp=1"])) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already holds another run's outputs" in err
    assert not dist.is_initialized()
