"""What the launcher says before a job starts: the layout with the layer split the run spec chose,
the model as the planner labels it, and one-line warnings for settings that rarely mean what
was intended."""
from __future__ import annotations

import os

from launcher.__main__ import model_label
from launcher.advice import launch_warnings, layout_line
from pipedream.config.run_spec import build_run_spec
from tests.support.training_harness import compose_config


def test_the_layout_line_gives_every_degree_and_the_chosen_split():
    six_layers = ["model.num_layers=4"]   # embedding + 4 blocks + head
    spec = build_run_spec(compose_config([*six_layers, "parallel.pp=4"]), world_size=4)
    assert layout_line(spec) == f"1f1b pp=4 tp=1 dp=1, layers per stage {[e - s for s, e in spec.bounds]}"
    assert sum(e - s for s, e in spec.bounds) == 6 and len(spec.bounds) == 4
    spec = build_run_spec(compose_config([*six_layers, "parallel.pp=2", "parallel.tp=2", "parallel.vpp=2",
                                          "schedule=interleaved", "train.global_batch_size=8",
                                          "train.micro_batch_size=2"]), world_size=4)
    assert layout_line(spec).startswith("interleaved pp=2 tp=2 dp=1 vpp=2, layers per virtual stage [")


def test_the_model_label_is_the_choice_the_planner_records():
    assert model_label(compose_config([]), []) == "gpt_tiny"   # the default choice, not the family "gpt"
    assert model_label(compose_config(["model=llama_tiny"]), ["model=llama_tiny"]) == "llama_tiny"


def test_more_ranks_than_cores_and_a_run_inside_warm_up_are_warned_in_one_line_each():
    cfg = compose_config(["train.steps=10", "train.warmup_steps=20"])
    notes = launch_warnings(cfg, procs_here=4, cores_here=2)
    assert notes[0].startswith("4 ranks on this node share 2 usable CPU core(s)")
    assert notes[1].startswith("train.steps=10 <= train.warmup_steps=20: the learning rate only warms up (the last "
                               "step runs at 50% of train.lr")
    assert all("\n" not in note for note in notes)
    assert launch_warnings(compose_config(["train.steps=21", "train.warmup_steps=20"]), 2, 2) == []
    assert launch_warnings(compose_config(["train.steps=3", "train.warmup_steps=0"]), 1, 2) == []


def test_the_launch_sets_the_thread_variable_torchrun_would_warn_about_and_prints_the_layout(
        tmp_path, monkeypatch, capsys):
    import launcher.__main__ as entry

    seen = {}

    def fake_run(command, grace_s, relayed=()):
        seen["threads"], seen["command"] = os.environ.get("OMP_NUM_THREADS"), command
        return 0

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(entry, "run_supervised", fake_run)
    assert entry.main(["train.threads=1", "launcher.check_memory=false", "launcher.bind_cores=false",
                       f"train.run_dir={tmp_path}/run"]) == 0
    assert seen["threads"] == "1" and "pipedream.train" in seen["command"]
    out = capsys.readouterr().out
    assert f"launch: 2 processes (2 on this node), 1f1b pp=2 tp=1 dp=1, layers per stage [3, 3]; run dir " \
           f"{tmp_path}/run" in out


def test_the_dry_run_prints_the_layout_before_the_command(tmp_path, capsys):
    import launcher.__main__ as entry

    assert entry.main(["parallel.pp=4", "launcher.dry_run=true", f"train.run_dir={tmp_path}/run"]) == 0
    layout, command = capsys.readouterr().out.strip().splitlines()
    assert layout.startswith("# 1f1b pp=4 tp=1 dp=1, layers per stage [") and command.startswith("torchrun ")
