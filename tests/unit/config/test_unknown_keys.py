"""A misspelt override key is named with the closest existing key and the keys of its group, in one
line, by the launcher, the planner and ``pipedream.train``."""
from __future__ import annotations

import os
import sys

import pytest
from hydra.errors import HydraException
from omegaconf import OmegaConf

from pipedream.config.loading import (compose_config, config_paths, describe_composition_error, describe_unknown_key,
                                      suggest_key, unknown_override_key)

CFG = OmegaConf.create({"train": {"steps": 1, "lr": 0.1, "seed": 0}, "optim": {"name": "adamw", "eps": 1e-8},
                        "checkpoint": {"every": 0, "keep": 2}, "model": {"preset": "${train.seed}"}})


def composition_error(overrides: list[str], config_name: str = "config") -> Exception:
    with pytest.raises(HydraException) as failed:
        compose_config(overrides, config_name)
    return failed.value


@pytest.mark.parametrize("key, suggestion, group", [
    ("train.step", "train.steps", "train"),        # a typo inside the right group
    ("trian.steps", "train.steps", ""),            # the group misspelt: the whole path is suggested
    ("optim.lrr", "train.lr", "optim"),            # a key of another group
    ("checkpoint.evry", "checkpoint.every", "checkpoint"),
    ("train.xyzzy", None, "train"),                # nothing close
])
def test_suggestion_and_group(key, suggestion, group):
    found, where, keys = suggest_key(key, CFG)
    assert (found, where) == (suggestion, group)
    assert keys == [str(k) for k in (CFG[group] if group else CFG).keys()]


def test_paths_are_listed_without_resolving_interpolations():
    assert "model.preset" in config_paths(CFG) and "train.steps" in config_paths(CFG)


def test_message_names_the_key_the_suggestion_and_the_group():
    assert describe_unknown_key("train.step", CFG) == ("train.step is not a config key; did you mean train.steps? "
                                                       "(keys of train: steps, lr, seed)")
    message = describe_unknown_key("train.xyzzy", CFG)
    assert "did you mean" not in message and "keys of train: steps, lr, seed" in message and "+train.xyzzy=" in message


def test_composed_config_misspelt_key_is_one_line_with_a_suggestion():
    overrides = ["model=resnet50_small", "train.step=5"]
    error = composition_error(overrides)
    assert unknown_override_key(error) == "train.step"
    message = describe_composition_error(error, overrides)
    assert "\n" not in message
    assert message.startswith("train.step is not a config key; did you mean train.steps? (keys of train: steps,")


def test_planner_config_is_searched_for_the_planner():
    overrides = ["planner.algoritm=harmony"]
    message = describe_composition_error(composition_error(overrides, "planner"), overrides, "planner")
    assert message.startswith("planner.algoritm is not a config key; did you mean planner.algorithm?")


def test_other_composition_errors_keep_their_own_line():
    assert describe_composition_error(composition_error(["model=nope"]), ["model=nope"]).startswith(
        "model=nope is unknown: choose one of")
    line = describe_composition_error(composition_error(["train.steps=["]), ["train.steps=["])
    assert line and "\n" not in line and "not a config key" not in line


def test_train_entry_point_refuses_a_misspelt_key_in_one_line(monkeypatch, capsys):
    from pipedream.train import main_refusing_bad_overrides
    monkeypatch.setattr(sys, "argv", ["pipedream.train", "train.step=5"])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exited:
        main_refusing_bad_overrides(["train.step=5"])
    assert exited.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: train.step is not a config key; did you mean train.steps?")
    assert "HYDRA_FULL_ERROR" not in os.environ
