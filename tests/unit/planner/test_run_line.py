"""The planner's last line is a command that trains its plan: every model, data and training
override it was given, quoted for a shell, and the plan; the launcher accepts exactly that."""
from __future__ import annotations

import shlex
from types import SimpleNamespace

from planner.__main__ import main as planner_main
from planner.config import compose
from planner.run_line import carried_overrides, missing_data_note, run_command
from pipedream.config.plan_config import apply_plan
from tests.support.training_harness import compose_config


def test_model_data_and_train_overrides_are_repeated_quoted_and_planner_keys_are_not():
    argv = ["model=llama_tiny", "model.vocab_size=2048", "data=token_bin", "data.path=my corpus/tok",
            "cluster=local_cpu", "train.global_batch_size=16", "planner.pp=2", "+model.extra=1"]
    assert carried_overrides(argv) == ["model=llama_tiny", "model.vocab_size=2048", "data=token_bin",
                                       "data.path=my corpus/tok", "train.global_batch_size=16", "+model.extra=1"]
    line = run_command(argv, compose(argv[:-1]), "out dir/plan.json", harmony=False)
    assert line == ("scripts/train.sh model=llama_tiny model.vocab_size=2048 data=token_bin 'data.path=my corpus/tok' "
                    "train.global_batch_size=16 +model.extra=1 'parallel.plan=out dir/plan.json'")
    assert shlex.split(line)[4] == "data.path=my corpus/tok"


def test_the_default_model_is_named_and_harmony_turns_clipping_off():
    assert run_command([], compose([]), "p.json", harmony=True) == \
        "scripts/train.sh model=gpt_tiny parallel.plan=p.json train.grad_clip=0"


def test_a_plugin_keeps_its_target_and_keys_and_is_told_about_its_data():
    argv = ["model._target_=my_pkg.net.build", "model.width=128", "planner.profile=profile.json"]
    cfg = SimpleNamespace(model={"_target_": "my_pkg.net.build", "width": 128})
    assert run_command(argv, cfg, "plan.json", harmony=False) == \
        "scripts/train.sh model._target_=my_pkg.net.build model.width=128 parallel.plan=plan.json"
    assert "data._target_=" in missing_data_note(cfg, argv)
    assert missing_data_note(cfg, argv + ["data._target_=my_pkg.net.data"]) is None


def test_the_printed_command_trains_the_plan_and_another_model_is_refused(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    given = ["model=llama_tiny", "model.vocab_size=2048", "model.num_layers=2", "train.global_batch_size=8"]
    assert planner_main([*given, "planner.pp=2", f"planner.out={plan}"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "(it sets parallel.pp=2 parallel.tp=1 parallel.cp=1 parallel.dp=" in line   # the degrees, cp among them
    assert "optim.distributed=" in line.split("run it with: ")[0]
    words = shlex.split(line.split("run it with: ", 1)[1])
    assert words[0] == "scripts/train.sh" and words[1:] == [*given, f"parallel.plan={plan}"]
    spec = apply_plan(compose_config(words[1:]), model_label="llama_tiny")
    assert spec.parallel.pp == 2 and spec.model.vocab_size == 2048


def test_the_planner_plans_the_global_batch_training_runs_by_default():
    """A dry run with no batch given plans the batch a run with no batch given trains."""
    assert compose([]).train.global_batch_size == compose_config([]).train.global_batch_size
