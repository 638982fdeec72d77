"""Device sheets, cluster presets and topologies; every model preset gives an analytic profile."""
from __future__ import annotations

import pytest
import yaml

from models import pipeline_layer_count
from pipedream.devices import DEVICES, GIB
from pipedream.config.loading import config_dir, config_options
from planner.errors import PlannerError
from planner.inputs.hardware import cluster_from_config, device_sheet
from planner.inputs.model_specs import spec_from_config
from planner.inputs.profile import analytic_profile

CONF = config_dir()
CLUSTERS = config_options("cluster")
# presets that state their sizes (model=hf reads them from its model.path folder: tests/unit/models/test_hf_family.py)
MODELS = [name for name in config_options("model")
          if "path" not in yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text())]


def load(group: str, name: str) -> dict:
    return yaml.safe_load((CONF / group / f"{name}.yaml").read_text())


def test_required_presets_exist():
    for name in ("dgx_a100", "pipedream_cluster_a", "pipedream_cluster_b", "v100_16gb_x8", "local_cpu"):
        assert name in CLUSTERS
    for name in ("gpt_1.7b", "gpt_1t", "gpt3_175b", "bert_large", "vgg16", "resnet50"):
        assert name in MODELS
    for sheet in ("a100_40gb", "a100_80gb", "v100_16gb", "v100_32gb", "h100_80gb", "h200", "gtx_1080ti"):
        assert sheet in DEVICES


@pytest.mark.parametrize("name", [c for c in CLUSTERS if c not in ("local_cpu", "measured")])  # measured on the spot
def test_cluster_presets(name):
    cfg = load("cluster", name)
    assert {"name", "device", "nodes", "devices_per_node"} <= set(cfg)  # the trainer's keys stay
    cluster = cluster_from_config(cfg)
    assert cluster.num_devices == cfg["nodes"] * cfg["devices_per_node"]
    assert cluster.levels[0].bandwidth > cluster.levels[-1].bandwidth  # faster inside a node


def test_dgx_a100_matches_the_paper():
    cluster = cluster_from_config({**load("cluster", "dgx_a100"), "nodes": 384})
    assert cluster.num_devices == 3072 and cluster.device.memory_bytes == 80 * GIB
    assert cluster.device.flops("bf16") == 312e12
    assert cluster.bandwidth_for_span(8) == 300e9  # NVSwitch inside the node
    assert cluster.bandwidth_for_span(16) == 25e9  # one 200 Gb/s HDR card per GPU
    assert cluster_from_config({**load("cluster", "dgx_a100"), "nodes": 2}).num_devices == 16


def test_local_cpu_is_measured():
    cfg = load("cluster", "local_cpu")
    assert cfg["device"] == "cpu"
    cluster = cluster_from_config(cfg)
    assert cluster.device.name == "local_cpu" and cluster.device.flops("fp32") > 1e8
    assert cluster.device.flops("bf16") == cluster.device.flops("fp32")  # no sheet entry: fp32


def test_unknown_sheet_is_one_line():
    with pytest.raises(PlannerError, match="not a known device") as err:
        device_sheet("tpu_v9")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", MODELS)
def test_model_presets_profile(name):
    cfg = load("model", name)
    spec = spec_from_config(cfg, "bf16")
    prof = analytic_profile(spec, DEVICES["a100_80gb"])
    assert prof.num_layers == pipeline_layer_count(cfg)
    assert prof.num_parameters > 0 and all(t > 0 for layer in prof.layers[1:] for t in layer.forward_s)
    if spec.num_parameters() > 1e9:  # far too large to build here: the trainer and launcher refuse them
        assert cfg.get("planner_only"), f"model={name} needs planner_only: true"


def test_bad_model_config():
    with pytest.raises(PlannerError, match="model.name='lstm'"):
        spec_from_config({"name": "lstm"})
    with pytest.raises(PlannerError, match="model.hidden_size is missing"):
        spec_from_config({"name": "gpt", "num_layers": 2})


def test_local_cpu_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    from planner.inputs import hardware

    timed = []
    monkeypatch.setattr(hardware, "_matmul_flops", lambda seconds: timed.append(seconds) or 4e10)
    cache = tmp_path / "local_cpu.json"
    first = hardware.measure_local_cpu(2, cache=cache)
    assert timed == [0.2] and first.flops("fp32") == 2e10        # the machine's speed, shared by 2 processes
    again = hardware.measure_local_cpu(4, cache=cache)
    assert timed == [0.2] and again.flops("fp32") == 1e10        # read back, not measured again
    cache.write_text("{not json")                                # a damaged cache is measured again
    hardware.measure_local_cpu(1, cache=cache)
    assert len(timed) == 2 and hardware.measure_local_cpu(1, cache=cache).flops("fp32") == 4e10
    monkeypatch.setenv("PIPEDREAM_CACHE_DIR", str(tmp_path / "elsewhere"))
    hardware.measure_local_cpu(1)
    assert (tmp_path / "elsewhere" / "local_cpu.json").exists() and len(timed) == 3


def test_the_default_dry_run_reads_the_cache_without_torch(tmp_path, monkeypatch):
    import sys

    from pipedream.observe.host import write_cache
    from planner.inputs.hardware import _host_key, measure_local_cpu

    write_cache(tmp_path / "local_cpu.json", _host_key(), 5e10)
    monkeypatch.setitem(sys.modules, "torch", None)   # any "import torch" now raises ImportError
    monkeypatch.setenv("PIPEDREAM_CACHE_DIR", str(tmp_path))
    assert measure_local_cpu(1).flops("fp32") == 5e10
