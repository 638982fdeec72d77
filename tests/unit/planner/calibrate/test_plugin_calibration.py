"""Plugin models (``model._target_``) on a measured sheet: the traced runs get the model's and the
data's overrides as the launcher takes them, and ``cluster=measured`` plans a plugin the sheet
holds a profile of (tests/distributed/test_planner_calibrate.py calibrates the example plugin for real)."""
from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from planner.calibrate.runtime import run_overrides
from planner.config import compose, inputs_from_config
from planner.errors import PlannerError
from planner.inputs.cluster_sheet import model_fingerprint
from planner.search.auto import make_plan
from tests.unit.planner.calibrate.test_calibration import write_sheet

PLUGIN = ["model._target_=maskseq.model.build", "model.width=16"]


def test_traced_runs_take_the_model_and_data_overrides():
    argv = [*PLUGIN, "data._target_=maskseq.data.build", "data.num_samples=64", "planner.calibrate_repeats=2",
            "cluster.devices_per_node=2", "+model.extra=1", "~data"]
    assert run_overrides(argv) == [*PLUGIN, "data._target_=maskseq.data.build", "data.num_samples=64",
                                   "+model.extra=1", "~data"]
    # a built-in model without a data choice runs on the synthetic data
    assert run_overrides(["model=gpt_tiny", "planner.calibrate_repeats=2"]) == ["model=gpt_tiny", "data=synthetic"]


def test_planner_config_takes_a_plugin_data_section():
    cfg = compose([*PLUGIN, "data._target_=maskseq.data.build", "data.num_samples=64"])
    assert OmegaConf.to_container(cfg.data) == {"_target_": "maskseq.data.build", "num_samples": 64}
    assert OmegaConf.to_container(cfg.model) == {"_target_": "maskseq.model.build", "width": 16}


def test_a_calibrated_plugin_is_planned_from_the_sheet(tmp_path):
    path = tmp_path / "sheet.json"
    sheet = write_sheet(path)
    plugin = OmegaConf.to_container(compose(PLUGIN).model)
    entry = dict(next(iter(sheet["profiles"].values())), model=plugin["_target_"], config=plugin)
    sheet["profiles"] = {model_fingerprint(plugin): entry}
    path.write_text(json.dumps(sheet))
    inputs = inputs_from_config(compose([*PLUGIN, "cluster=measured", f"cluster.calibration={path}",
                                         "train.global_batch_size=8"]))
    assert inputs.profile.source == "measured" and inputs.model == "gpt_tiny"   # the sheet's profile, by its label
    assert make_plan(inputs, "ptdp", "strict", False).plan.parallel.pp >= 1
    other = [PLUGIN[0], "model.width=32"]   # a configuration the sheet has no profile of
    with pytest.raises(PlannerError, match="no analytic sizes.*python -m planner.calibrate model._target_="
                                           "maskseq.model.build data._target_=.*cluster=measured"):
        inputs_from_config(compose([*other, "cluster=measured", f"cluster.calibration={path}"]))
