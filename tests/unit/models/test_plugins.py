"""Plugins through Hydra's ``_target_``: the command-line form, a good plugin's run spec, and one
line naming the target for every way a plugin can be wrong (before any process group)."""
from __future__ import annotations

import pytest

from pipedream.config.loading import compose_config
from pipedream.errors import ConfigError
from models.plugin_config import plugin_overrides
from pipedream.config.run_spec import build_run_spec

GOOD_DATA = ["data._target_=tests.support.plugin_cases.good_data"]
RUN = ["parallel.pp=2", "train.global_batch_size=8", "train.micro_batch_size=2"]


def spec_of(*overrides: str):
    return build_run_spec(compose_config([*RUN, *overrides]), 2)


def test_target_overrides_replace_the_preset():
    assert plugin_overrides(["model._target_=a.b", "model.width=3", "train.steps=1"]) == [
        "~model", "++model._target_=a.b", "++model.width=3", "train.steps=1"]
    assert plugin_overrides(["model=mlp", "model.hidden_size=3"]) == ["model=mlp", "model.hidden_size=3"]
    once = plugin_overrides(["data._target_=a.b", "+data.n=2"])
    assert plugin_overrides(once) == once == ["~data", "++data._target_=a.b", "++data.n=2"]


def test_a_plugin_model_and_data_set_make_a_run_spec():
    cfg = compose_config(["model._target_=tests.support.plugin_cases.good_model", "model.width=6", *GOOD_DATA, *RUN])
    assert dict(cfg.model) == {"_target_": "tests.support.plugin_cases.good_model", "width": 6}
    spec = build_run_spec(cfg, 2)
    assert spec.num_layers == 3 and spec.bounds == ((0, 2), (2, 3))   # the nested Sequential is flattened
    assert spec.seq_len is None


BAD_MODELS = {
    "no_such_package.build": "cannot be imported",
    "tests.support.plugin_cases.no_such_function": "cannot be imported",
    "tests.support.plugin_cases.not_callable": "cannot be imported",
    "tests.support.plugin_cases.returns_a_module": "returned Sequential, not a models.LayerModel",
    "tests.support.plugin_cases.shapes_do_not_chain": "layers do not chain: layer 1 (Linear) fails on a float32 tensor of "
                                              "shape [2, 8]",
    "tests.support.plugin_cases.loss_not_scalar": "the loss returned a float32 tensor of shape [2, 2], not a scalar",
    "tests.support.plugin_cases.loss_not_a_tensor": "the loss returned a float, not a scalar",
    "tests.support.plugin_cases.layer_returns_a_dict": "layer 1 (ToDict) returned a dict: a layer returns a tensor or a tuple",
    "tests.support.plugin_cases.raises": "raised TypeError",   # width is missing
}


@pytest.mark.parametrize("target", BAD_MODELS)
def test_a_bad_model_plugin_is_one_line_naming_the_target(target):
    with pytest.raises(ConfigError) as error:
        spec_of(f"model._target_={target}", *GOOD_DATA)
    message = str(error.value)
    assert message.startswith(f"model._target_={target}") and BAD_MODELS[target] in message
    assert "\n" not in message


def test_an_error_raised_by_the_plugin_is_reported():
    with pytest.raises(ConfigError, match="raised RuntimeError: no model of width 3: fix the plugin"):
        spec_of("model._target_=tests.support.plugin_cases.raises", "model.width=3", *GOOD_DATA)


BAD_DATA = {
    "tests.support.plugin_cases.data_not_a_pair": "returned TensorDataset, not (train, validation)",
    "tests.support.plugin_cases.data_bad_samples": "returned (list, list), not (train, validation)",
    "tests.support.plugin_cases.data_unpaired_samples": "train samples are (a float32 tensor of shape [4]), not (input, "
                                                "target) pairs",
    "tests.support.plugin_cases.data_too_wide": "its batches do not fit model._target_=tests.support.plugin_cases.good_model: layer 0 "
                                        "(Linear) fails on a float32 tensor of shape [2, 5]",
    "tests.support.plugin_cases.tied_data": "its batches do not fit model._target_=tests.support.plugin_cases.good_model: the loss "
                                    "fails on output a float32 tensor of shape [2, 2] and target a float32 tensor "
                                    "of shape [2, 4]",
    "no_such_package.data": "cannot be imported",
}


@pytest.mark.parametrize("target", BAD_DATA)
def test_a_bad_data_plugin_is_one_line_naming_the_target(target):
    with pytest.raises(ConfigError) as error:
        spec_of("model._target_=tests.support.plugin_cases.good_model", f"data._target_={target}")
    message = str(error.value)
    assert message.startswith(f"data._target_={target}") and BAD_DATA[target] in message
    assert "\n" not in message


def test_a_plugin_model_needs_plugin_data():
    with pytest.raises(ConfigError, match="model._target_=tests.support.plugin_cases.good_model needs its data as a plugin"):
        spec_of("model._target_=tests.support.plugin_cases.good_model")


def test_a_plugin_model_has_no_tensor_parallel_form():
    with pytest.raises(ConfigError, match="has no tensor-parallel form"):
        spec_of("model._target_=tests.support.plugin_cases.good_model", *GOOD_DATA, "parallel.tp=2", "parallel.pp=1")


def test_the_readme_example_is_a_valid_plugin(tmp_path, monkeypatch):
    """README's "Your own model" snippet, as written, passes every pre-check with its command line."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme.split("## Your own model", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    command = section.split("```bash\n", 1)[1].split("```", 1)[0].split()
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "net.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = [word for word in command if "=" in word and not word.startswith("PYTHONPATH")]
    spec = build_run_spec(compose_config(overrides), 2)
    assert spec.layout.pp == 2 and spec.num_layers == 3


def test_the_planner_plans_a_plugin_only_from_a_measured_profile():
    from planner.config import compose, inputs_from_config
    from planner.errors import PlannerError

    with pytest.raises(PlannerError, match="model._target_=tests.support.plugin_cases.good_model has no analytic sizes: "
                                           "measure it first"):
        inputs_from_config(compose(["model._target_=tests.support.plugin_cases.good_model"]))


def test_a_measured_profile_counts_every_member_of_a_tuple(monkeypatch):
    from pathlib import Path

    from planner.calibrate.measure import measure_profile

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3] / "examples" / "masked_sequences"))
    width, length = 8, 6
    profile = measure_profile({"_target_": "maskseq.model.build", "width": width, "max_len": length}, [1, 2], "cpu",
                              warmup=0, repeats=1)
    # embedding and blocks send (hidden float32, mask bool) per sample; the head ends in the loss
    assert [layer.output_bytes for layer in profile.layers] == [length * (width * 4 + 1)] * 3 + [0.0]
    assert profile.layers[1].activation_bytes_recompute == length * (width * 4 + 1)
    assert all(t > 0 for layer in profile.layers for t in (*layer.forward_s, *layer.backward_s))
    assert profile.model == "maskseq.model.build" and profile.num_parameters > 0


def test_parameters_tied_across_stages_are_refused_by_the_asynchronous_schedules():
    tied = ["model._target_=tests.support.plugin_cases.tied_across_layers", "data._target_=tests.support.plugin_cases.tied_data"]
    assert spec_of(*tied).num_layers == 4   # 1F1B all-reduces the tied gradients
    with pytest.raises(ConfigError, match=r"ties module.weight of layer 0 to layer 3 across stages \[0, 1\], which "
                                          r"schedule=2bw updates at different times"):
        spec_of(*tied, "schedule=2bw")
