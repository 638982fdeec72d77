"""The entry point validates once: ``build_run_spec`` folds every section the runtime reads into the
``RunSpec`` (preemption, fused model sets, the model and data sections as plain data), and nothing
below ``pipedream.train`` takes or reads the Hydra config."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipedream.config.run_spec import build_run_spec
from pipedream.errors import ConfigError
from pipedream.config.preemption import PreemptionSpec
from pipedream.config.multi_model import multi_model_spec
from pipedream.trainer import train
from tests.support.training_harness import compose_config

MLP = ["model=mlp", "data=synthetic", "model.num_layers=2", "model.hidden_size=8", "parallel.pp=1",
       "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=2"]
PIPEDREAM = Path(__file__).resolve().parents[2] / "pipedream"
# where the Hydra config is read: the entry point, the validation, and the torch-free settings
# readers that the validation (and the launcher) call
CONFIG_READERS = {"train.py", "config", "lifecycle/preemption.py"}


def test_the_spec_carries_every_section_the_runtime_reads() -> None:
    cfg = compose_config(MLP + ["train.models=2", "preemption.signal=USR2"])
    spec = build_run_spec(cfg, world_size=1)
    assert spec.preemption == PreemptionSpec.from_config(cfg)
    assert spec.multi_model == multi_model_spec(cfg) and spec.multi_model.count == 2
    assert spec.config == OmegaConf.to_container(cfg, resolve=True)
    assert type(spec.model_config) is dict and spec.model_config == spec.config["model"]
    assert type(spec.data_config) is dict and spec.data_config["name"] == "synthetic"
    assert build_run_spec(compose_config(MLP), world_size=1).multi_model is None


def test_preemption_settings_are_refused_with_the_rest() -> None:
    with pytest.raises(ConfigError, match="preemption.requeue_exit_code=1 must be an integer from 3 to 125"):
        build_run_spec(compose_config(MLP + ["preemption.requeue_exit_code=1"]), world_size=1)


def test_the_trainer_takes_the_spec_only() -> None:
    assert list(inspect.signature(train).parameters) == ["spec", "ctx"]


def _below_entry_point() -> list[Path]:
    def reads_config(path: Path) -> bool:
        relative = path.relative_to(PIPEDREAM)
        return str(relative) in CONFIG_READERS or relative.parts[0] in CONFIG_READERS
    return [p for p in sorted(PIPEDREAM.rglob("*.py")) if not reads_config(p)]


def test_nothing_below_the_entry_point_reads_the_hydra_config() -> None:
    """No ``cfg`` parameter, no Hydra, no DictConfig; OmegaConf only formats config.yaml's YAML."""
    found = []
    for path in _below_entry_point():
        name = path.relative_to(PIPEDREAM)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [f"{name}: {node.name}(cfg)" for a in node.args.args + node.args.kwonlyargs if a.arg == "cfg"]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("hydra", "omegaconf"):
                found += [f"{name}: imports {alias.name}" for alias in node.names if alias.name != "OmegaConf"]
            elif isinstance(node, ast.Import):
                found += [f"{name}: imports {alias.name}" for alias in node.names
                          if alias.name.split(".")[0] in ("hydra", "omegaconf")]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id == "OmegaConf" and node.attr != "to_yaml":
                found.append(f"{name}: OmegaConf.{node.attr}")
    assert found == []
