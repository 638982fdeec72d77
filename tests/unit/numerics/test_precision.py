"""Mixed precision in one process: the config rules (one line each, before any process group),
the casts that put boundary tensors in the compute dtype, apex's wiring, the plan's precision and
the planner's bytes per parameter."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from torch import nn

from models.boundary import TupleSpec
from pipedream.errors import ConfigError
from pipedream.numerics.optim import build_optimizer
from pipedream.config.plan_config import apply_plan
from pipedream.numerics.precision import MixedPrecision
from pipedream.config.run_spec import build_run_spec
from planner.inputs.model_specs import parameter_bytes
from tests.support.training_harness import compose_config
from tests.unit.config.test_plan_config import write_plan


def test_precision_choices_and_loss_scaler_settings():
    assert build_run_spec(compose_config([])).precision.name == "fp32"
    spec = build_run_spec(compose_config(["precision=fp16", "precision.growth_interval=7"])).precision
    assert spec.name == "fp16" and spec.loss_scale.growth_interval == 7 and spec.loss_scale.backoff_factor == 0.5
    assert build_run_spec(compose_config(["precision=bf16"])).precision.loss_scale is None
    with pytest.raises(ConfigError, match="precision='fp8' is unknown"):
        build_run_spec(compose_config(["precision=bf16", "precision.name=fp8"]))
    with pytest.raises(ConfigError, match="backoff_factor"):
        build_run_spec(compose_config(["precision=fp16", "precision.backoff_factor=2.0"]))


@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_fp16_is_refused_for_the_asynchronous_schedules_and_bf16_is_not(schedule):
    async_cfg = [f"schedule={schedule}", "model.tie_embeddings=false"]
    with pytest.raises(ConfigError, match=f"precision=fp16 with schedule={schedule}: .*use precision=bf16"):
        build_run_spec(compose_config(async_cfg + ["precision=fp16"]))
    assert build_run_spec(compose_config(async_cfg + ["precision=bf16"])).precision.name == "bf16"


def test_apex_without_apex_is_one_line_before_launch(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + [p for p in sys.path if "apex" not in p])
    with pytest.raises(ConfigError, match="optim.impl=apex, but NVIDIA apex is not importable"):
        build_run_spec(compose_config(["optim.impl=apex"]))
    with pytest.raises(ConfigError, match="optim.impl='fused' is unknown"):
        build_run_spec(compose_config(["optim.impl=fused"]))


FAKE_APEX = {  # apex's package layout, with torch stand-ins, to check what is wired to what
    "apex/__init__.py": "",
    "apex/optimizers/__init__.py": "from .fused_adam import FusedAdam, FusedSGD\n",
    "apex/optimizers/fused_adam.py": """
        import torch
        class FusedAdam(torch.optim.AdamW):
            def __init__(self, params, adam_w_mode=True, **kw):
                assert adam_w_mode
                super().__init__(params, **kw)
        class FusedSGD(torch.optim.SGD):
            pass
        """,
    "apex/normalization/__init__.py": """
        import torch
        class FusedLayerNorm(torch.nn.LayerNorm):
            pass
        """,
}


def test_apex_optimizer_and_layer_norm_where_apex_is_installed(monkeypatch, tmp_path):
    for name, text in FAKE_APEX.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in [m for m in sys.modules if m == "apex" or m.startswith("apex.")]:
        monkeypatch.delitem(sys.modules, module)
    with pytest.raises(ConfigError, match="needs cluster.device=cuda"):
        build_run_spec(compose_config(["optim.impl=apex"]))
    spec = build_run_spec(compose_config(["optim.impl=apex", "cluster.device=cuda"]))
    optimizer = build_optimizer(spec.optim, [nn.Parameter(torch.ones(2, 2))], lr=0.1)
    assert type(optimizer).__name__ == "FusedAdam"
    from pipedream.numerics.apex import use_apex_layer_norm
    block = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    state = {k: v.clone() for k, v in block.state_dict().items()}
    assert use_apex_layer_norm(block) == 1 and type(block[1]).__name__ == "FusedLayerNorm"
    assert all(torch.equal(state[k], v) for k, v in block.state_dict().items())


def test_layer_outputs_and_boundary_specs_are_in_the_compute_dtype():
    bf16 = MixedPrecision("bf16", "cpu")
    embedding, linear = nn.Embedding(10, 4), nn.Linear(4, 4)
    bf16.apply([embedding, linear])
    with bf16.autocast():
        hidden = embedding(torch.tensor([[1, 2]]))
        assert hidden.dtype == torch.bfloat16          # the hook casts what autocast leaves in fp32
        assert linear(hidden).dtype == torch.bfloat16
    assert embedding.weight.dtype == torch.float32     # parameters stay fp32 (the master weights)
    spec = (torch.Size([2, 4]), torch.float32)
    assert bf16.on_wire(spec) == (torch.Size([2, 4]), torch.bfloat16)
    pair = TupleSpec((spec, (torch.Size([2]), torch.int64)))
    assert bf16.on_wire(pair) == TupleSpec(((torch.Size([2, 4]), torch.bfloat16), (torch.Size([2]), torch.int64)))
    assert MixedPrecision("fp32", "cpu").on_wire(spec) == spec
    loss = bf16.fp32_loss(lambda logits, target: logits.sum())(torch.ones(2, dtype=torch.bfloat16), None)
    assert loss.dtype == torch.float32


def test_the_plan_records_precision_and_the_runtime_follows_it(tmp_path):
    path = tmp_path / "plan.json"
    write_plan(path)
    plan = json.loads(path.read_text())
    path.write_text(json.dumps({**plan, "precision": "fp16"}))
    spec = build_run_spec(apply_plan(compose_config([f"parallel.plan={path}", "precision=bf16"])), world_size=2)
    assert spec.precision.name == "fp16" and spec.precision.loss_scale.initial_scale == 65536.0
    path.write_text(json.dumps({**plan, "precision": "fp8"}))
    with pytest.raises(ConfigError, match="made for precision fp8, which training does not run"):
        apply_plan(compose_config([f"parallel.plan={path}"]))


def test_planner_bytes_per_parameter():
    fp32, bf16 = parameter_bytes("fp32"), parameter_bytes("bf16")
    assert (fp32.weights, fp32.gradients, fp32.master, fp32.optimizer) == (4, 4, 0, 8)
    assert (bf16.weights, bf16.gradients, bf16.master, bf16.optimizer) == (2, 2, 4, 8)
    assert fp32.total == bf16.total == 16
