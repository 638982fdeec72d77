"""The model-family registry (``models.registry``): every registered family builds its smallest
trainable preset with the layers, parameters and FLOPs its facts state, has a planner spec and
data to train on; and no code outside ``models`` branches on a family's name."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from models import build_model
from models.errors import ConfigError
from models.facts import flops_per_sample, parameter_count, pipeline_layer_count
from models.family import DATA_KINDS
from models.plugins import CHECK_BATCH, meta_forward_flops
from models.registry import MODEL_FAMILIES, model_family
from planner.inputs.model_specs import SPEC_BUILDERS, spec_from_config

ROOT = Path(__file__).resolve().parents[3]
PRESETS = [yaml.safe_load(path.read_text()) for path in sorted((ROOT / "conf" / "model").glob("*.yaml"))]
OUTSIDE_MODELS = ("pipedream", "planner", "launcher")


def smallest_trainable_preset(name: str, files: Path) -> dict:
    """A family reading its sizes from the model's own files (model=hf) gets a tiny saved model."""
    # MoE presets route data-dependently (no meta-device forward): tests/unit/models/test_moe*.py
    trainable = [cfg for cfg in PRESETS if cfg.get("name") == name and not cfg.get("planner_only")
                 and not cfg.get("moe")]
    assert trainable, f"model family {name} has no trainable preset in conf/model/"
    family = model_family(name)
    if family.config_from_files is not None:
        pytest.importorskip("transformers")
        from tests.support.hf_models import save_tiny
        with_files = {**trainable[0], "path": str(save_tiny("llama", files / name))}
        return {**with_files, **family.config_from_files(with_files)}
    return min(trainable, key=parameter_count)


@pytest.mark.parametrize("name", MODEL_FAMILIES)
def test_the_smallest_preset_is_what_the_facts_say(name, tmp_path):
    cfg = smallest_trainable_preset(name, tmp_path)
    model = build_model(cfg)
    assert model.num_layers == pipeline_layer_count(cfg) == len(model_family(name).layer_kinds(model.num_layers))
    # a tied embedding and head are one Parameter in the sequential model, counted once
    assert sum(p.numel() for p in model.build_sequential().parameters()) == parameter_count(cfg)
    # torch's FlopCounterMode on a forward of the example batch; BERT's MLM transform is left out of eq. 4.2
    measured = meta_forward_flops(model, f"model={name}") / CHECK_BATCH
    assert measured == pytest.approx(flops_per_sample(cfg, recompute=False) / 3, rel=0.05)


@pytest.mark.parametrize("name", MODEL_FAMILIES)
def test_the_planner_has_an_analytic_spec_of_the_same_model(name, tmp_path):
    family, cfg = model_family(name), smallest_trainable_preset(name, tmp_path)
    assert family.analytic_spec in SPEC_BUILDERS
    spec = spec_from_config(cfg)
    assert len(spec.layer_specs(1)) == pipeline_layer_count(cfg)
    assert spec.num_parameters() == parameter_count(cfg)
    assert family.data_kind in DATA_KINDS
    assert family.sequence == ("seq_len" in cfg)
    assert set(family.required_keys) <= set(cfg)


def test_an_unknown_family_is_one_line_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"^model.name='gpt4' is not a model family; known: gpt, bert, mlp, "
                                          r"vgg16, resnet50, llama, hf ") as error:
        model_family("gpt4")
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="not a model family"):
        parameter_count({"name": "gpt4"})


def family_name_branches(source: str, where: str) -> list[str]:
    """Comparisons (==, !=, in, not in) with a family-name literal or a literal collection holding
    one, and dicts keyed by family names, in ``source`` (named ``where``): one "where:line" each."""
    names = set(MODEL_FAMILIES)

    def names_a_family(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names if isinstance(node.value, str) else False
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names_a_family(element) for element in node.elts)
        return False

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(names_a_family(side) for side in [node.left, *node.comparators]):
            found.append(f"{where}:{node.lineno}")
        elif isinstance(node, ast.Dict) and any(key is not None and names_a_family(key) for key in node.keys):
            found.append(f"{where}:{node.lineno}")
    return found


def test_no_code_outside_models_branches_on_a_family_name():
    """Outside ``models`` a family is asked for its facts (``model_family(name).data_kind``, ...):
    adding a family then needs no edit there."""
    offenders = [where for package in OUTSIDE_MODELS for path in sorted((ROOT / package).rglob("*.py"))
                 for where in family_name_branches(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]
    assert not offenders, f"compare model names with family names outside models/: {offenders}"


def test_the_scan_finds_name_branches():
    source = ('if cfg.model.name in ("vgg16", "resnet50"):\n    pass\nkinds = {"mlp": 1}\n'
              'deep = family == "bert"\nfine = {"name": "gpt"}\n')
    assert family_name_branches(source, "x.py") == ["x.py:1", "x.py:3", "x.py:4"]
