"""No plan claims more than its device can do: on every cluster preset, for every model preset (and
the default model), the chosen plan's and every alternative's hardware FLOP/s per device (the FLOPs
the devices run: 4 passes with recomputation, 3 without) stay at or below the device's peak at the
plan's precision. The CPU presets reserve a CPU process's memory, not a GPU's."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from pipedream.config.loading import config_options
from planner.config import compose, inputs_from_config
from planner.errors import PlannerError
from planner.inputs import hardware
from planner.search.auto import make_plan
from tests.unit.planner.calibrate.test_calibration import write_sheet

GIB = 1024**3


@pytest.fixture(scope="module")
def cpu_sheet():
    return hardware.measure_local_cpu(2, seconds=0.05)   # measured once, for every local_cpu plan


def _cluster_overrides(cluster: str, tmp_path) -> list[str]:
    if cluster != "measured":
        return [f"cluster={cluster}"]
    write_sheet(tmp_path / "sheet.json")
    return ["cluster=measured", f"cluster.calibration={tmp_path / 'sheet.json'}"]


@pytest.fixture(scope="module")
def model_configs():
    """Every model preset composed once (the default model first); each cluster's test puts its
    cluster section in them, which is what composing the pair would give (nothing else reads the
    choice, and ``inputs_from_config`` changes nothing in the config)."""
    configs = []
    for model in [None, *config_options("model")]:
        try:
            cfg = compose(["planner.top_k=8"] + ([f"model={model}"] if model else []))
        except PlannerError:   # a preset that needs more (model=hf: its folder) claims nothing
            continue
        OmegaConf.set_struct(cfg, False)
        configs.append(cfg)
    return configs


@pytest.mark.parametrize("cluster", config_options("cluster"))
def test_no_plan_exceeds_the_device_peak(cluster, tmp_path, monkeypatch, cpu_sheet, model_configs):
    monkeypatch.setattr(hardware, "measure_local_cpu", lambda devices=1, seconds=0.2: cpu_sheet)
    planned = 0
    cluster_section = OmegaConf.to_container(compose(_cluster_overrides(cluster, tmp_path)).cluster)
    for cfg in model_configs:
        cfg.cluster = cluster_section
        try:
            inputs = inputs_from_config(cfg)
            outcome = make_plan(inputs, "auto", "strict", simulate=False)
        except PlannerError:   # too large for this cluster: nothing is claimed
            continue
        precision = inputs.spec.precision if inputs.spec is not None else inputs.profile.precision
        peak = inputs.cluster.device.flops(precision)
        for c in (outcome.result.best, *outcome.result.alternatives):
            assert c.tflops_per_device * 1e12 <= peak * (1 + 1e-9), (inputs.model, c.describe(), c.tflops_per_device)
            assert c.model_tflops_per_device <= c.tflops_per_device * (1 + 1e-9)
        planned += 1
    assert planned >= 2, cluster


def test_a_cpu_device_reserves_a_cpu_process_not_a_gpu(cpu_sheet, monkeypatch):
    monkeypatch.setattr(hardware, "measure_local_cpu", lambda devices=1, seconds=0.2: cpu_sheet)
    inputs = inputs_from_config(compose([]))
    assert inputs.workspace == pytest.approx(0.5 * GIB + 0.1 * inputs.capacity)   # conf/cluster/local_cpu.yaml
    gpu = inputs_from_config(compose(["cluster=dgx_a100"]))
    assert gpu.workspace == pytest.approx(3 * GIB + 0.2 * 80 * GIB)
    given = inputs_from_config(compose(["planner.reserve_gib=1", "planner.reserve_fraction=0"]))
    assert given.workspace == pytest.approx(GIB)
    with pytest.raises(PlannerError, match="planner.reserve_gib=-1 must be a number >= 0"):
        inputs_from_config(compose(["planner.reserve_gib=-1"]))
