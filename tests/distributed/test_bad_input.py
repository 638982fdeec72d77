"""Every unusable configuration is refused before any process starts, with one line that names the
value, the rule and a way out, and a non-zero exit. The catalogue's end-to-end cases
(tests/support/bad_input_catalogue.py) go through the real command lines, which must never start torchrun."""
from __future__ import annotations

import pytest

from launcher.__main__ import main as launch
from pipedream.errors import ConfigError
from pipedream.config.run_spec import build_run_spec
from tests.support.bad_input_catalogue import CATALOGUE, END_TO_END, make_fixtures
from tests.support.processes import run_cli
from tests.support.training_harness import compose_config

E2E_SECONDS = 30   # a refusal takes ~1-3 s; a launched job waits 120 s for a dead peer

CASES = [
    (["model=nope"], "model=nope is unknown"),
    (["data=nope"], "data=nope is unknown"),
    (["optim=lion"], "optim=lion is unknown"),
    (["schedule=zigzag"], "schedule=zigzag is unknown"),
    (["model.hidden_size=0"], "model.hidden_size = 0 must be a positive integer"),
    (["train.micro_batch_size=-1"], "train.micro_batch_size = -1 must be a positive integer"),
    (["parallel.pp=0"], "parallel.pp = 0 must be an integer >= 1"),
    (["parallel.pp=1", "parallel.dp=3"], "not divisible by parallel.dp*train.micro_batch_size = 3*4 = 12"),
    (["data=text_file", "data.path=/no/such/file.txt"], "does not exist"),
    (["data=text_file"], "data=text_file needs data.path"),
    (["+data.seq_len=512"], "exceeds the model's context model.seq_len=64"),
    (["model.num_heads=3"], "model.num_heads=3 does not divide model.hidden_size=128"),
    (["schedule=interleaved", "parallel.pp=4", "parallel.vpp=2", "train.global_batch_size=24", "model.num_layers=8"],
     "needs microbatches (6) to be a multiple of pp (4)"),
    (["parallel.pp=4", "parallel.vpp=2", "schedule=interleaved"], "fewer than pp*vpp = 8"),
    (["parallel.layers_per_stage=[2,2]"], "sums to 4 but the model has 6 layers"),
    (["parallel.vpp=2"], "needs schedule=interleaved"),
    (["model=mlp"], "use data=synthetic"),
    (["model=vgg16"], "model=vgg16 trains on images, not data=pydoc: use data=synthetic_images"),
    (["model=resnet50_small", "data=image_folder"], "data=image_folder needs data.path"),
    (["model=resnet50_small", "data=synthetic_images", "model.image_size=16"], "too small for resnet50"),
    (["model=resnet50_small", "data=synthetic_images", "train.micro_batch_size=1"], "one value per channel"),
    (["model=vgg16_small", "data=image_folder", "data.path=/no/such/folder"], "is not a folder"),
    (["parallel.tp=3", "parallel.pp=1"], "model.num_heads=4 is not divisible by parallel.tp=3"),
    (["recompute.granularity=partial"], "recompute.granularity='partial' is not supported"),
    (["train.weight_grads_delay=-1"], "train.weight_grads_delay = -1 must be an integer >= 0"),
]


@pytest.mark.parametrize("overrides,message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_launcher_refuses_with_one_line(capsys, overrides, message):
    assert launch(overrides + ["launcher.dry_run=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1 and err.startswith("error: ")


def test_world_size_mismatch_names_both_numbers():
    cfg = compose_config(["parallel.pp=2", "parallel.dp=2"])
    with pytest.raises(ConfigError, match=r"parallel.pp\*tp\*cp\*dp = 2\*1\*1\*2 = 4 but WORLD_SIZE = 3"):
        build_run_spec(cfg, world_size=3)


def test_training_entry_refuses_before_any_process_group(monkeypatch, capsys):
    import torch.distributed as dist

    from pipedream.train import run
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert run(compose_config(["parallel.pp=2"])) == 2
    assert "WORLD_SIZE = 3" in capsys.readouterr().err
    assert not dist.is_initialized()


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return make_fixtures(tmp_path_factory.mktemp("catalogue"), other_model_checkpoint=False)


E2E_CASES = [c for c in CATALOGUE if c.id in END_TO_END]


def test_end_to_end_cases_are_in_the_catalogue():
    assert len(E2E_CASES) == len(END_TO_END)


@pytest.mark.parametrize("case", E2E_CASES, ids=[c.id for c in E2E_CASES])
def test_command_line_refuses_before_torchrun(case, fixtures, tmp_path):
    done = run_cli(case.tool, case.args(fixtures), tmp_path)
    assert done.commands, "the probe recorded nothing: is tests/support/process_probe on PYTHONPATH?"
    assert not done.launched, f"{case.id}: torchrun or a rank started: {done.launched}"
    assert done.code == 2 and len(done.stderr_lines) == 1, (done.code, done.stderr_lines)
    assert done.stderr_lines[0].startswith("error: ") and case.expect in done.stderr_lines[0]
    assert done.seconds < E2E_SECONDS
