"""``compose_plain``: the planner's start-up path composes plain overrides without Hydra, and must
give exactly Hydra's config: every value form it reads as Hydra's override grammar does, every
preset and override set below composed to the same YAML, struct flag and group choices, and
everything else left to Hydra (None)."""
from __future__ import annotations

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf, open_dict

from pipedream.config import loading
from pipedream.config.loading import compose_config, compose_plain, config_options, plain_value
from pipedream.config.yaml_files import NotPlain

VALUES = ["1", "0", "-3", "12", "1.", ".5", "-.5", "1.5", "1e5", "1E-3", "300.0e9", "4e9", "1.0e-9", "1e5x", "1f1b",
          "2bw", "zb_h2", "true", "false", "null", "infx", "nanx", "gpt_1.7b", "/tmp/a/graph.txt", "./x", ".", "a-b",
          "a.b.c", "x/y-z.json", "1.5e3.txt", "e5", "_x", "5-a", "v100_16gb", "[]", "[1]", "[1,2]", "[1f1b,gpipe]",
          "[true,false]", "[1,2.5,x]"]
LEFT_TO_HYDRA = ["0123", "1_000", "1_0e5", "True", "NULL", "inf", "-inf", "nan", "NaN", "-a", "+5", "[1, 2]",
                 "[a,[b]]", "", "a b", "a:b", "${x}", "'q'", "a,b", "1.5.2", "1-2"]


def _typed(value):
    return [_typed(v) for v in value] if isinstance(value, list) else (type(value), value)


@pytest.mark.parametrize("text", VALUES)
def test_plain_values_read_as_hydra_reads_them(text):
    hydra = OverridesParser.create().parse_override(f"k={text}").value()
    assert _typed(plain_value(text)) == _typed(list(hydra) if isinstance(hydra, list) else hydra)


@pytest.mark.parametrize("text", LEFT_TO_HYDRA)
def test_other_values_are_left_to_hydra(text):
    with pytest.raises(NotPlain):
        plain_value(text)


def _hydra(overrides):
    cfg = compose_config(overrides, "planner", return_hydra_config=True)
    choices = dict(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, {k: choices[k] for k in ("model", "data", "cluster")}


OVERRIDES = [[f"model={m}"] for m in config_options("model")] + [[f"cluster={c}"] for c in config_options("cluster")] + [
    [],
    ["model=gpt_small", "cluster=dgx_a100", "cluster.nodes=4", "planner.schedules=[1f1b,gpipe]",
     "train.global_batch_size=32", "planner.out=/tmp/x.json", "planner.reserve_gib=1e3", "planner.tp=null"],
    ["planner.graph=/tmp/vgg16/graph.txt", "cluster=pipedream_cluster_a", "cluster.devices_per_node=4",
     "planner.pipedream_costs=released", "planner.memory_constraint=false", "planner.recompute=[false]"],
    ["model.hidden_size=256", "model.num_heads=8", "data=pydoc", "planner.calibrate_micro_batches=[]"],
]


@pytest.mark.parametrize("overrides", OVERRIDES, ids=" ".join)
def test_the_same_config_as_hydra(overrides):
    plain = compose_plain(overrides, "planner")
    if plain is None:   # only where Hydra's composition fails too (model=hf without model.path): its error
        with pytest.raises(Exception):
            _hydra(overrides)
        return
    cfg, choices = plain
    reference, reference_choices = _hydra(overrides)
    assert OmegaConf.to_yaml(cfg) == OmegaConf.to_yaml(reference)
    assert choices == reference_choices and OmegaConf.is_struct(cfg) and OmegaConf.is_struct(reference)


@pytest.mark.parametrize("overrides", [
    ["model._target_=my_pkg.build"],   # a plugin: Hydra's ~model ++model... form
    ["planner.algoritm=ptdp"],         # an unknown key: Hydra's error names it
    ["model=nope"], ["+planner.x=1"], ["planner.top_k=1,2"], ["hydra.job.name=x"],
    ["train.global_batch_size=8", "train.global_batch_size=16"],
])
def test_anything_else_is_left_to_hydra(overrides):
    assert compose_plain(overrides, "planner") is None


def test_a_primary_config_with_hydra_entries_is_left_to_hydra():
    assert compose_plain([], "config") is None   # config.yaml overrides hydra/job_logging


def _hydra_training(overrides):
    from hydra import compose, initialize_config_dir

    from pipedream.config.loading import complete_model_config, config_dir
    with initialize_config_dir(str(config_dir()), version_base=None):
        return complete_model_config(compose("config", overrides=list(overrides)))


TRAINING = [[f"{group}={option}"] for group in ("model", "data", "optim", "cluster", "schedule", "precision")
            for option in config_options(group) if option != "hf"] + [
    [],
    ["model=llama_tiny", "parallel.pp=4", "parallel.tp=2", "parallel.sequence_parallel=true", "train.steps=3",
     "recompute.granularity=selective", "train.models=2"],
    ["schedule=interleaved", "parallel.vpp=2", "parallel.layers_per_stage=[1,2,3]", "train.compile=aot_eager",
     "checkpoint.every=5", "train.resume=auto", "optim.distributed=true", "launcher.bind_cores=false"],
]


@pytest.mark.parametrize("overrides", TRAINING, ids=" ".join)
def test_training_configs_are_hydras_without_its_node(overrides, monkeypatch):
    """``compose_config`` (no Hydra node asked for) composes plain overrides of ``config.yaml`` without
    Hydra: the config Hydra's compose returns, which leaves its own node out."""
    calls = []   # compose_config's own compose_plain call, recorded: the plain path composed once

    def recorded(*args, **kwargs):
        calls.append((args, kwargs, compose_plain(*args, **kwargs)))
        return calls[-1][2]

    monkeypatch.setattr(loading, "compose_plain", recorded)
    cfg = compose_config(overrides)
    assert [call[:2] for call in calls] == [((overrides, "config"), {"without_hydra_node": True})]
    plain = calls[0][2]
    reference = _hydra_training(overrides)
    assert plain is not None and cfg is plain[0]   # compose_config returned the plain config
    assert OmegaConf.to_yaml(plain[0]) == OmegaConf.to_yaml(reference)
    assert OmegaConf.is_struct(plain[0]) and OmegaConf.is_struct(reference)


@pytest.mark.parametrize("overrides", [["train.models=[{lr:0.1}]"], ["launcher.bind_cores=[[0],[1]]"],
                                       ["model._target_=examples.masked_sequences.model.build"]])
def test_training_overrides_outside_the_plain_grammar_go_to_hydra(overrides):
    assert compose_plain(overrides, "config", without_hydra_node=True) is None


def test_the_run_dir_timestamp_resolves_without_hydra():
    """``train.run_dir: runs/${now:...}``: the plain path registers Hydra's ``now`` resolver itself."""
    OmegaConf.clear_resolver("now")
    cfg, _ = compose_plain([], "config", without_hydra_node=True)
    assert str(OmegaConf.to_container(cfg, resolve=True)["train"]["run_dir"]).startswith("runs/2")


def test_the_yaml_rules_are_omegaconfs():
    """The plain path restates OmegaConf's YAML loader (so as not to import OmegaConf): the same
    implicit types, and every config file read to the same values."""
    from omegaconf._utils import get_yaml_loader
    import yaml

    from pipedream.config.loading import config_dir
    from pipedream.config.yaml_files import yaml_loader
    assert yaml_loader().yaml_implicit_resolvers == get_yaml_loader().yaml_implicit_resolvers
    for path in sorted(config_dir().rglob("*.yaml")):
        text = path.read_text()
        assert yaml.load(text, Loader=yaml_loader()) == yaml.load(text, Loader=get_yaml_loader()), path
    values = "a: 1e5\nb: 1.0e+5\nc: 2001-12-14\nd: .inf\ne: 0x10\nf: 1_000\ng: yes\nh: ~\n"
    assert yaml.load(values, Loader=yaml_loader()) == yaml.load(values, Loader=get_yaml_loader())


@pytest.mark.parametrize("overrides", OVERRIDES, ids=" ".join)
def test_plain_dicts_are_the_same_values(overrides):
    """``compose_plain_dicts`` (``python -m planner``'s start-up, no OmegaConf) gives the plain
    containers of ``compose_plain``'s config, and the same choices."""
    from pipedream.config.loading import PlainConfig, compose_plain_dicts

    reference = compose_plain(overrides, "planner")
    plain = compose_plain_dicts(overrides, "planner")
    if reference is None or reference[0].model.get("path") is not None:   # model=hf: its files, OmegaConf's path
        assert plain is None
        return
    cfg, choices = plain
    assert cfg == OmegaConf.to_container(reference[0]) and choices == reference[1]
    assert isinstance(cfg.planner, PlainConfig) and cfg.planner.top_k == cfg["planner"]["top_k"]
    with pytest.raises(AttributeError):
        cfg.planner.algoritm


@pytest.mark.parametrize("overrides", [["planner.algoritm=ptdp"], ["model=nope"], ["+planner.x=1"],
                                       ["model.name.x=1"], ["planner.top_k.x=1"]])
def test_plain_dicts_leave_the_rest_to_omegaconf_and_hydra(overrides):
    from pipedream.config.loading import compose_plain_dicts

    assert compose_plain_dicts(overrides, "planner") is None


def test_plain_dicts_refuse_interpolations():
    """``train.run_dir: runs/${now:...}``: OmegaConf resolves it, so ``config.yaml`` is not plain data."""
    from pipedream.config.loading import _as_plain_config

    with pytest.raises(NotPlain):
        _as_plain_config({"train": {"run_dir": "runs/${now:%Y}"}})
    with pytest.raises(NotPlain):
        _as_plain_config({"model": {"path": "???"}})


@pytest.mark.parametrize("overrides", [["model=gpt_small"], ["planner.graph=/tmp/g/graph.txt", "cluster=pipedream_cluster_a"],
                                       ["model._target_=my_pkg.build"]])
def test_the_planner_reads_the_same_config_either_way(overrides):
    """``planner.config.compose(..., plain_dicts=True)``: the values of the OmegaConf config, the model's
    preset label included; a plugin model (Hydra's path) comes back as OmegaConf's config."""
    from planner.config import compose

    fast, reference = compose(overrides, plain_dicts=True), compose(overrides)
    plain = fast if isinstance(fast, dict) else OmegaConf.to_container(fast)
    assert plain == OmegaConf.to_container(reference)
    assert isinstance(fast, dict) != bool(reference.model.get("_target_"))


def test_a_value_over_a_mapping_is_left_to_hydra():
    from pipedream.config.loading import _update

    with pytest.raises(NotPlain):
        _update({"a": {"b": {"c": 1}}}, "a.b", 1)
    cfg = {"a": {"b": None}}
    _update(cfg, "a.b", [1, 2])
    assert cfg == {"a": {"b": [1, 2]}}


def test_parsed_values_are_cached_while_the_text_is_the_same(tmp_path, monkeypatch):
    """``conf/__pycache__`` keeps each file's parsed values: reused only for the same text, a fresh
    copy each time, not written under ``PYTHONDONTWRITEBYTECODE``."""
    from pipedream.config.yaml_files import ConfigFiles

    monkeypatch.setattr("sys.dont_write_bytecode", False)
    path = tmp_path / "model" / "m.yaml"
    path.parent.mkdir()
    path.write_text("name: gpt\nlayers: [1, 2]\nlr: 1e-3\n")
    first = ConfigFiles(tmp_path)
    assert first.load(path) == {"name": "gpt", "layers": [1, 2], "lr": 1e-3} and first.loader is not None
    first.save()
    again = ConfigFiles(tmp_path)
    values = again.load(path)
    assert values == {"name": "gpt", "layers": [1, 2], "lr": 1e-3} and again.loader is None   # not parsed
    values["layers"].append(3)
    assert again.load(path)["layers"] == [1, 2]
    path.write_text("name: gpt\nlayers: [4]\nlr: 1e-3\n")
    edited = ConfigFiles(tmp_path)
    assert edited.load(path)["layers"] == [4] and edited.loader is not None
    monkeypatch.setattr("sys.dont_write_bytecode", True)
    edited.save()
    not_cached = ConfigFiles(tmp_path)
    assert not_cached.load(path)["layers"] == [4] and not_cached.loader is not None   # parsed again
