"""``models.facts`` agrees with the models the trainer builds, with the runtime's metrics and with
the planner's analytic specs: one number per model fact, whoever asks."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from models import build_model, pipeline_layer_count
from models.facts import flops_per_iteration, flops_per_sample, parameter_count
from pipedream.observe.metrics import model_flops_per_iteration
from planner.inputs.model_specs import spec_from_config

CONF = Path(__file__).resolve().parents[3] / "conf" / "model"
SMALL = {"name": "gpt", "num_layers": 2, "hidden_size": 32, "num_heads": 2, "seq_len": 16, "vocab_size": 64}
# the trainable presets, and variants that change the layer list or the parameter count
CONFIGS = {
    "gpt_tiny": yaml.safe_load((CONF / "gpt_tiny.yaml").read_text()),
    "bert_tiny": yaml.safe_load((CONF / "bert_tiny.yaml").read_text()),
    "mlp": yaml.safe_load((CONF / "mlp.yaml").read_text()),
    "gpt_untied": {**SMALL, "tie_embeddings": False},
    "bert_pre_ln": {**SMALL, "name": "bert", "pre_ln": True},
    "bert_untied": {**SMALL, "name": "bert", "tie_embeddings": False, "num_layers": 3},
    "llama_tiny": yaml.safe_load((CONF / "llama_tiny.yaml").read_text()),
    "llama_tied_mha": {**SMALL, "name": "llama", "num_kv_heads": 2, "ffn_hidden_size": 48, "tie_embeddings": True},
}


@pytest.mark.parametrize("name", CONFIGS)
def test_layers_and_parameters_match_the_built_model(name):
    cfg = CONFIGS[name]
    model = build_model(cfg)
    assert pipeline_layer_count(cfg) == model.num_layers
    # a tied embedding and head are one Parameter in the sequential model, counted once
    assert parameter_count(cfg) == sum(p.numel() for p in model.build_sequential().parameters())


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("recompute", [False, True])
def test_flops_are_the_runtimes_and_the_planners(name, recompute):
    cfg, batch = CONFIGS[name], 8
    expected = flops_per_iteration(cfg, batch, recompute)
    assert model_flops_per_iteration(cfg, batch, None, recompute) == expected
    assert spec_from_config(cfg).flops_per_sample(recompute) * batch == pytest.approx(expected, rel=1e-12)
    assert flops_per_sample(cfg, recompute) * batch == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", [*CONFIGS, "bert_large", "gpt3_175b", "llama3_405b", "vgg16", "resnet50", "vgg16_small",
                                  "resnet50_small"])
def test_the_planner_splits_the_same_layers(name):
    cfg = CONFIGS.get(name) or yaml.safe_load((CONF / f"{name}.yaml").read_text())
    spec = spec_from_config(cfg)
    assert len(spec.layer_specs(1)) == pipeline_layer_count(cfg)
    assert spec.num_parameters() == parameter_count(cfg)


def test_a_shorter_sequence_counts_fewer_flops():
    cfg = CONFIGS["gpt_tiny"]
    assert flops_per_iteration(cfg, 4, False, seq_len=16) < flops_per_iteration(cfg, 4, False)
    assert model_flops_per_iteration(cfg, 4, 16, False) == flops_per_iteration(cfg, 4, False, seq_len=16)
