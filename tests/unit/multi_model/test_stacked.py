"""Stacked parameters: batched twins equal to the K modules run alone, which layers fold and which
run under vmap, per-model views at the edges (state dicts, in-place loading, ties), the optimizer
on the stacks (exactly torch's per-model update) and clipping by each model's own norm."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from models.boundary import call_layer
from models.families.gpt import gpt_model
from pipedream.multi_model.spec import ModelVariant, MultiModelSpec
from pipedream.config.specs import OptimSpec
from pipedream.multi_model.fused import FusedLayer, fuse_models
from pipedream.runtime.fused_training import PerModelGradientSync, build_multi_optimizer


def _members(factory, count=3):
    members = []
    for k in range(count):
        torch.manual_seed(20 + k)
        module = factory()
        with torch.no_grad():   # distinct affine parameters, not torch's constant initialisation
            for param in module.parameters():
                param.add_(torch.randn_like(param) * 0.1)
        members.append(module)
    return members


TWIN_CASES = {
    "linear": (lambda: nn.Linear(5, 7), (4, 3, 5), False),
    "layer_norm": (lambda: nn.LayerNorm(6), (4, 3, 6), False),
    "embedding": (lambda: nn.Embedding(11, 4), (4, 3), True),
    "conv2d": (lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2), (2, 4, 9, 9), False),
    "batch_norm": (lambda: nn.BatchNorm2d(5), (4, 5, 3, 3), False),
}


@pytest.mark.parametrize("case", sorted(TWIN_CASES))
@pytest.mark.parametrize("groups", [1, 3])
def test_a_batched_twin_computes_each_model_as_alone(case, groups):
    factory, shape, indices = TWIN_CASES[case]
    members = _members(factory)
    alone = [copy.deepcopy(m) for m in members]
    fused = FusedLayer(members, 0, groups)
    generator = torch.Generator().manual_seed(4)
    x = torch.randint(11, (3, *shape), generator=generator) if indices else torch.randn(3, *shape, generator=generator)
    out = fused(x)
    assert fused.folds and type(fused.body).__name__.startswith("Batched")
    weights = torch.arange(out[0].numel()).view(out[0].shape).sin()   # a loss that sees every output
    (out * weights).sum().backward()
    for k, module in enumerate(alone):
        expected = module(x[k])
        torch.testing.assert_close(out[k], expected, rtol=1e-5, atol=1e-6)
        (expected * weights).sum().backward()
        for name, param in module.named_parameters():
            torch.testing.assert_close(fused.body.get_parameter(name).grad[k], param.grad, rtol=1e-5, atol=1e-5)
        for name, buffer in module.named_buffers():   # batch-norm running statistics, per model
            torch.testing.assert_close(fused.body.get_buffer(name)[k], buffer)


def test_gpt_blocks_fold_and_the_embedding_and_head_run_under_vmap():
    members = [gpt_model(2, 16, 2, 8, vocab_size=32, seed=k) for k in range(2)]
    fused = fuse_models(members, MultiModelSpec((), None))
    layers = fused.build()
    x, y = fused.make_batch(3, torch.Generator().manual_seed(0))
    value = x
    for i in range(fused.num_layers):
        value = call_layer(layers[i], value)
    fused.loss_fn(value, y).backward()
    # positions have no batch dimension (embedding); the head uses its weight directly
    assert [layers[i].folds for i in range(4)] == [False, True, True, False]
    # tied: the head's stack is the embedding's table's stack
    assert layers[3].body.weight is layers[0].body.wte.weight
    for k, member in enumerate(members):
        alone = member.build_sequential()
        out = alone(x[k])
        member.loss_fn(out, y[k]).backward()
        torch.testing.assert_close(value[k], out, rtol=1e-5, atol=1e-6)
        for name, param in alone.named_parameters():
            layer, rest = name.split(".", 1)
            torch.testing.assert_close(layers[int(layer)].body.get_parameter(rest).grad[k], param.grad,
                                       rtol=1e-4, atol=1e-6)


def test_the_edges_see_k_ordinary_models_as_views_of_the_stacks():
    members = [gpt_model(1, 8, 2, 4, vocab_size=16, seed=k) for k in range(2)]
    layers = fuse_models(members, MultiModelSpec((), None)).build()
    state = layers[0].per_model_module().state_dict()
    single = members[1].build_layer(0).state_dict()
    assert sorted(state) == sorted(f"models.{k}.{name}" for k in range(2) for name in single)
    torch.testing.assert_close(state["models.1.wte.weight"], single["wte.weight"])
    # loading writes into the stacks in place
    view = layers[0].per_model_module()
    view.load_state_dict({key: torch.full_like(value, 3.0) for key, value in state.items()})
    assert torch.all(layers[0].body.wte.weight == 3.0)
    # a tied stack has one set of views: the head's checkpoint names are the same parameters
    head = layers[2].per_model_module()
    assert head.models[1].weight is view.models[1].wte.weight


def _spec(*variants):
    return MultiModelSpec(tuple(ModelVariant(k, k, lr, wd) for k, (lr, wd) in enumerate(variants)), 1)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
@pytest.mark.parametrize("settings", [((0.1, 0.5), (0.01, 0.0)), ((0.1, 0.5), (0.01, 0.0), (0.1, 0.5))],
                         ids=["own", "shared"])
def test_the_optimizer_on_the_stacks_is_torchs_update_of_each_model(name, settings):
    """Models with the same learning rate and weight decay share their groups (one fused call)."""
    torch.manual_seed(0)
    count = len(settings)
    stacks = [nn.Parameter(torch.randn(count, 4, 3)), nn.Parameter(torch.randn(count, 3))]
    alone = [[nn.Parameter(s.detach()[k].clone()) for s in stacks] for k in range(count)]
    spec = _spec(*settings)
    optim = OptimSpec(name=name, weight_decay=0.0, fused=True, impl="torch", distributed=False, betas=(0.9, 0.99),
                      eps=1e-8, momentum=0.9)
    stacked_optimizer = build_multi_optimizer(optim, stacks, spec)
    assert len(stacked_optimizer.param_groups) == 2 * len(set(settings))
    assert [stacked_optimizer.param_groups[g]["lr"] for g in stacked_optimizer.model_groups] == [lr for lr, _ in settings]
    torch_class = torch.optim.AdamW if name == "adamw" else torch.optim.SGD
    extra = {"momentum": 0.9} if name == "sgd" else {"betas": (0.9, 0.99), "eps": 1e-8}
    plain = [torch_class([{"params": [p[0]], "weight_decay": v.weight_decay}, {"params": [p[1]], "weight_decay": 0.0}],
                         lr=v.lr, fused=True, **extra) for p, v in zip(alone, spec.variants)]
    for step in range(3):
        grads = [torch.randn_like(s) for s in stacks]
        for stack, grad in zip(stacks, grads):
            if stack.grad is None:
                stack.grad = grad.clone()
            else:
                stack.grad.add_(grad)
        stacked_optimizer.step()
        stacked_optimizer.zero_grad()   # in place: the views stay linked to the stacks' gradients
        assert all(torch.count_nonzero(s.grad) == 0 for s in stacks)
        if step == 1:   # a new gradient tensor (set_to_none by other code) is linked again
            for stack in stacks:
                stack.grad = None
        for k in range(count):
            for param, grad in zip(alone[k], grads):
                param.grad = grad[k].clone()
            plain[k].step()
    for k in range(count):
        for stack, param in zip(stacks, alone[k]):
            assert torch.equal(stack.detach()[k], param.detach())


def test_each_model_is_clipped_by_its_own_norm():
    stacks = [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(2, 4))]
    stacks[0].grad = torch.tensor([[3.0, 0.0, 0.0], [0.1, 0.0, 0.0]])
    stacks[1].grad = torch.tensor([[0.0, 4.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    sync = PerModelGradientSync(stacks, None, 1, [], None, count=2)
    total = sync.clip(1.0)
    assert sync.last_norms == pytest.approx([5.0, 0.1])
    assert total == pytest.approx((25 + 0.01) ** 0.5)
    torch.testing.assert_close(stacks[0].grad[0], torch.tensor([3.0, 0.0, 0.0]) / (5.0 + 1e-6))
    torch.testing.assert_close(stacks[1].grad[0], torch.tensor([0.0, 4.0, 0.0, 0.0]) / (5.0 + 1e-6))
    assert torch.equal(stacks[0].grad[1], torch.tensor([0.1, 0.0, 0.0]))   # below the limit: untouched


class Tally(nn.Module):
    """A buffer updated in place and a parameter used directly: no twin."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(5))
        self.register_buffer("seen", torch.zeros(5))

    def forward(self, x):
        self.seen.add_(x.detach().sum(0))
        return x * self.scale


def test_a_module_without_a_twin_runs_under_vmap_on_the_stacks():
    """vmap over the stacks: each model's buffer updated in place in the stacked buffer."""
    members = _members(Tally, count=2)
    alone = [copy.deepcopy(m) for m in members]
    fused = FusedLayer(members, 0)
    x = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        out = fused(x)
    assert fused.folds is False
    for k, module in enumerate(alone):
        for _ in range(2):
            expected = module(x[k])
        torch.testing.assert_close(out[k], expected)
        torch.testing.assert_close(fused.body.seen[k], module.seen)
