"""Eq. 4.2-4.4 against the dissertation's numbers, and the cost model's closed forms."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from models.families.formulas import gpt_flops_per_iteration, gpt_parameters, training_days
from pipedream.config.loading import config_dir
from planner.costs import closed_form as cost
from planner.costs.collectives import ring_time
from planner.inputs.model_specs import TransformerSpec, resnet50, spec_from_config, vgg16

CONF = config_dir() / "model"

# Table 4.1 (dissertation ch. 4.5.1): layers, hidden, heads, parameters (billion), t, p, GPUs, batch
TABLE_4_1 = [
    (24, 2304, 24, 1.7, 1, 1, 32, 512), (30, 3072, 32, 3.6, 2, 1, 64, 512), (36, 4096, 32, 7.5, 4, 1, 128, 512),
    (40, 6144, 48, 18.4, 8, 1, 256, 1024), (48, 8192, 64, 39.1, 8, 2, 512, 1536),
    (60, 10240, 80, 76.1, 8, 4, 1024, 1792), (80, 12288, 96, 145.6, 8, 8, 1536, 2304),
    (96, 16384, 128, 310.1, 8, 16, 1920, 2160), (105, 20480, 128, 529.6, 8, 35, 2520, 2520),
    (128, 25600, 160, 1008.0, 8, 64, 3072, 3072)]


@pytest.mark.parametrize("row", TABLE_4_1, ids=lambda r: f"{r[3]}B")
def test_eq_4_3_matches_table_4_1(row):
    layers, hidden, _, billions, *_ = row
    assert round(gpt_parameters(layers, hidden, 51200, 2048) / 1e9, 1) == billions


@pytest.mark.parametrize("row", TABLE_4_1, ids=lambda r: f"{r[3]}B")
def test_presets_match_table_4_1(row):
    layers, hidden, heads, billions, *_ = row
    name = "gpt_1t" if billions > 1000 else f"gpt_{billions}b"
    cfg = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    assert (cfg["num_layers"], cfg["hidden_size"], cfg["num_heads"], cfg["seq_len"], cfg["vocab_size"]) == \
        (layers, hidden, heads, 2048, 51200)
    spec = spec_from_config(cfg)
    assert round(spec.num_parameters() / 1e9, 1) == billions
    # the built model: eq. 4.3 plus the final LayerNorm; the per-layer specs add the tied head's copy of V h
    assert spec.num_parameters() == gpt_parameters(layers, hidden, 51200, 2048) + 2 * hidden
    total = sum(layer.parameters for layer in spec.layer_specs(1))
    assert total - spec.num_parameters() == pytest.approx(51200 * hidden)


def test_eq_4_2_flops():
    b, s, l, h, v = 3, 2048, 24, 2304, 51200
    expected = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert gpt_flops_per_iteration(b, l, h, v, s) == pytest.approx(expected, rel=1e-12)
    # without recomputation: 3 passes for the blocks, the logit layer unchanged
    no_rec = 72 * b * s * l * h * h * (1 + s / (6 * h)) + 6 * b * s * h * v
    assert gpt_flops_per_iteration(b, l, h, v, s, recompute=False) == pytest.approx(no_rec, rel=1e-12)
    # the analytic layers count the same forward FLOPs: 24Bsh^2 + 4Bs^2h per block, 2BshV logits
    spec = TransformerSpec("g", "gpt", l, h, 24, s, v)
    fwd = sum(layer.forward_flops for layer in spec.layer_specs(1))
    assert 3 * fwd * b == pytest.approx(gpt_flops_per_iteration(b, l, h, v, s, recompute=False), rel=1e-12)


def test_eq_4_4_gpt3_example():
    """175B parameters, 300B tokens, 1024 A100s at 140 TFLOP/s: about 34 days (ch. 4.5.1)."""
    assert round(training_days(300e9, 175e9, 1024, 140e12)) == 34
    assert round(training_days(450e9, 1.008e12, 3072, 163e12)) == 84  # the trillion-parameter example


def test_cnn_specs():
    vgg, res = vgg16(), resnet50()
    assert vgg.num_layers == 16 and res.num_layers == 18
    assert vgg.num_parameters() == pytest.approx(138.36e6, rel=0.01)  # VGG-16: 138M parameters
    assert res.num_parameters() == pytest.approx(25.5e6, rel=0.03)  # ResNet-50: 25.6M
    assert sum(x.forward_flops for x in vgg.layers) == pytest.approx(2 * 15.5e9, rel=0.03)  # 15.5 GMACs
    assert sum(x.forward_flops for x in res.layers) == pytest.approx(2 * 4.1e9, rel=0.05)  # 4.1 GMACs


def test_cost_closed_forms():
    assert cost.bubble_fraction("1f1b", 8, 32) == pytest.approx(7 / 32)
    assert cost.bubble_fraction("gpipe", 8, 32) == pytest.approx(7 / 32)
    assert cost.bubble_fraction("interleaved", 8, 32, 4) == pytest.approx(7 / 128)
    assert cost.bubble_fraction("2bw", 8, 32) == 0 and cost.bubble_fraction("pipedream", 8, 32) == 0
    assert ring_time(100.0, 4, 10.0) == pytest.approx(2 * 3 / 4 * 10)
    assert cost.in_flight("1f1b", 4, np.arange(4), 8).tolist() == [4, 3, 2, 1]
    assert cost.in_flight("gpipe", 4, 0, 8) == 8
    assert cost.in_flight("interleaved", 4, 0, 8, 2) * 2 == (4 - 1) * 2 + 4 + 1
    assert cost.in_flight("pipedream", 2, 0, 8, devices_downstream=4, replicas=3) == 2  # NOAM ceil(4/3)
    assert cost.weight_versions("2bw") == 2 and cost.weight_versions("1f1b") == 1
    assert cost.pipedream_stage_time(6.0, 1.0, 3, 1.0) == pytest.approx(max(6.0, 4.0) / 3)
    # eq. 4.1: (m + p - 1)(t_f + t_b)
    assert cost.flush_iteration_time("1f1b", 3.0, 4, 16) == pytest.approx((16 + 3) * 3.0)


def test_every_formula_names_its_source():
    """Every function in cost.py that computes something cites the dissertation or a paper."""
    text = (Path(__file__).resolve().parents[4] / "planner" / "costs" / "closed_form.py").read_text()
    for name, body in re.findall(r"def (\w+)\(.*?\):\n(.*?)(?=\ndef |\Z)", text, flags=re.S):
        assert re.search(r"ch\. \d|eq\. \d|Patarasuk|Table", body), f"{name} has no source"
