"""Fused model sets without processes: settings and refusals, fused layers equal to the K models
run one by one (forward and gradients), any fusion degree, layers that cannot fuse."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from models import from_modules
from models.families.mlp import mlp_model
from models.boundary import call_layer
from pipedream.config.loading import compose_config
from pipedream.errors import ConfigError
from pipedream.config.multi_model import multi_model_spec
from pipedream.multi_model.fused import build_fused_model
from pipedream.multi_model.degree import divisors, measure_fusion_groups, set_fusion_groups
from pipedream.multi_model.export import is_fused_state, split_models
from pipedream.multi_model.fused import NotFusableError, check_fusable, fuse_models
from pipedream.config.multi_model import check_multi_model
from pipedream.multi_model.spec import MultiModelSpec
from pipedream.config.run_spec import build_run_spec


def config(models, groups="auto", **train):
    return OmegaConf.create({"train": {"models": models, "fusion_groups": groups, "seed": 5, "lr": 0.01, **train},
                             "optim": {"weight_decay": 0.1}, "precision": {"name": "fp32"}})


def test_settings_give_each_model_its_seed_and_overrides():
    spec = multi_model_spec(config([{"lr": 0.5}, {"seed": 9, "weight_decay": 0.0}, None]))
    assert [(v.seed, v.lr, v.weight_decay) for v in spec.variants] == [(5, 0.5, 0.1), (9, 0.01, 0.0),
                                                                        (7, 0.01, 0.1)]
    assert spec.fusion_groups is None
    assert multi_model_spec(config(4, 2)).fusion_groups == 2
    assert multi_model_spec(config(None)) is None


@pytest.mark.parametrize("models,groups,message", [
    ([{"momentum": 0.9}], "auto", "cannot change"), (4, 3, "divisor"), ("four", "auto", "model count"),
    ([], "auto", "empty"), ([{"lr": -1.0}], "auto", "positive"), ([{"seed": 1.5}], "auto", "integer")])
def test_bad_settings_are_refused_in_one_line(models, groups, message):
    with pytest.raises(ConfigError, match=message) as error:
        multi_model_spec(config(models, groups))
    assert "\n" not in str(error.value)


def test_asynchronous_schedules_and_tensor_parallelism_are_refused():
    with pytest.raises(ConfigError, match="flush schedules"):
        check_multi_model(config(2), "2bw", True, 1, "torch")
    with pytest.raises(ConfigError, match="parallel.tp=1"):
        check_multi_model(config(2), "1f1b", False, 2, "torch")


def _alone_and_fused(count: int, groups: int):
    members = [mlp_model(3, 8, seed=10 * k) for k in range(count)]
    fused = fuse_models(members, MultiModelSpec((), None), groups)
    layers = fused.build()
    x, y = fused.make_batch(4, torch.Generator().manual_seed(1))
    value = x
    for i in range(fused.num_layers):
        value = call_layer(layers[i], value)
    fused.loss_fn(value, y).backward()
    return members, layers, x, y, value


@pytest.mark.parametrize("count,groups", [(2, 1), (4, 1), (4, 2), (4, 4)])
def test_fused_layers_compute_each_model_as_alone(count, groups):
    members, layers, x, y, value = _alone_and_fused(count, groups)
    for k, member in enumerate(members):
        alone = member.build_sequential()
        out = alone(x[k])
        member.loss_fn(out, y[k]).backward()
        torch.testing.assert_close(value[k], out, rtol=1e-6, atol=1e-6)
        for name, param in alone.named_parameters():
            layer, rest = name.split(".", 1)
            stacked = layers[int(layer)].body.get_parameter(rest)   # one [K, ...] parameter, no per-model leaves
            assert layers[int(layer)].models[k].get_parameter(rest).data_ptr() == stacked[k].data_ptr()
            torch.testing.assert_close(stacked.grad[k], param.grad, rtol=1e-5, atol=1e-6)


def test_fusion_degree_changes_no_value():
    _, layers, x, _, _ = _alone_and_fused(4, 1)
    outputs = []
    for groups in divisors(4):
        set_fusion_groups(list(layers.values()), groups)
        value = x
        for i in range(len(layers)):
            value = call_layer(layers[i], value)
        outputs.append(value.detach())
    assert divisors(4) == [1, 2, 4]
    for other in outputs[1:]:
        assert torch.equal(other, outputs[0])


def test_the_fusion_degree_is_timed_for_every_divisor_and_leaves_no_gradient():
    members = [mlp_model(2, 8, seed=k) for k in range(4)]
    layers = fuse_models(members, MultiModelSpec((), None)).build()
    chunk = nn.Sequential(layers[0], layers[1])
    x = torch.randn(4, 3, 8)
    timings = measure_fusion_groups([chunk], [x], 4, repeats=1)
    assert sorted(timings) == [1, 2, 4] and all(t > 0 for t in timings.values())
    assert all(p.grad is None for p in chunk.parameters())


def _plugin(module_factory):
    def build():
        return from_modules(nn.Sequential(nn.Linear(4, 6), module_factory(), nn.Linear(6, 2)), F.mse_loss,
                            (torch.randn(2, 4), torch.randn(2, 2)))
    return build


def test_plugin_layers_fuse():
    members = [_plugin(nn.GELU)() for _ in range(2)]
    check_fusable(fuse_models(members, MultiModelSpec((), None)))


class Branchy(nn.Module):
    def forward(self, x):
        return x * 2 if x.max() > 0 else x


def test_a_layer_with_data_dependent_control_flow_is_refused_naming_it():
    members = [_plugin(Branchy)() for _ in range(2)]
    with pytest.raises(NotFusableError, match=r"layer 1 \(Branchy\) cannot run fused under torch.vmap: "
                                              r"vmap: .*data-dependent control flow$"):
        check_fusable(fuse_models(members, MultiModelSpec((), None)))


def test_batch_norm_keeps_each_models_running_statistics():
    torch.manual_seed(0)
    members = [_plugin(lambda: nn.BatchNorm1d(6))() for _ in range(2)]
    fused = fuse_models(members, MultiModelSpec((), None))
    layers = fused.build()
    x, _ = fused.make_batch(5, torch.Generator().manual_seed(3))
    value = x
    for i in range(3):
        value = call_layer(layers[i], value)
    for k, member in enumerate(members):
        alone = member.build_sequential()
        torch.testing.assert_close(value[k], alone(x[k]))
        torch.testing.assert_close(layers[1].models[k].module.running_var, alone[1].module.running_var)


def test_different_architectures_are_refused():
    with pytest.raises(NotFusableError, match="layer 0"):
        fuse_models([mlp_model(2, 8), mlp_model(2, 16)], MultiModelSpec((), None)).build_layer(0)


def test_a_builtin_model_set_builds_fused():
    cfg = OmegaConf.create({"model": {"name": "mlp", "num_layers": 2, "hidden_size": 8},
                            **config(2)})
    assert build_fused_model(cfg.model, multi_model_spec(cfg)).num_layers == 2


def test_export_splits_a_fused_state_into_single_models():
    state = {"0.models.0.fc1.weight": 1, "0.models.1.fc1.weight": 2, "1.models.1.fc2.bias": 3}
    assert is_fused_state(state) and not is_fused_state({"0.fc1.weight": 1})
    assert split_models(state) == [{"0.fc1.weight": 1}, {"0.fc1.weight": 2, "1.fc2.bias": 3}]


class ScaledAccumulate(nn.Module):
    """Uses its parameter directly (no batched twin: the layer runs under vmap) and adds into a
    tensor it creates, which vmap cannot batch."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        total = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        total += x * self.scale
        return total


def scaled_accumulate():
    return from_modules(nn.Sequential(nn.Linear(4, 8), ScaledAccumulate(), nn.Linear(8, 2)), F.mse_loss,
                        (torch.randn(2, 4), torch.randn(2, 2)))


def test_a_layer_vmap_cannot_batch_fuses_when_it_folds():
    """No state and the batch first: the folded layer runs its own code once on K*B samples."""
    from tests.support.plugin_cases import accumulates_in_place

    fused = fuse_models([accumulates_in_place() for _ in range(2)], MultiModelSpec((), None))
    check_fusable(fused)
    layer = fused.build_layer(1)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(layer(x), x)
    assert layer.folds


def test_a_plugin_that_cannot_fuse_is_refused_before_any_process_group():
    cfg = compose_config([f"model._target_={__name__}.scaled_accumulate", "data._target_=tests.support.plugin_cases.good_data",
                          "parallel.pp=1", "train.global_batch_size=8", "train.micro_batch_size=2", "train.models=2"])
    with pytest.raises(ConfigError) as error:
        build_run_spec(cfg, 1)
    assert str(error.value).startswith("train.models=2: layer 1 (ScaledAccumulate) cannot run fused under torch.vmap: ")
    assert "train.models=null" in str(error.value) and "\n" not in str(error.value)
