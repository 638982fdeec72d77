"""The optimizer builder: fused kernels by default, the foreach ones on request or as fallback."""
from __future__ import annotations

import pytest
import torch

from pipedream.numerics.optim import build_optimizer, parameter_groups
from pipedream.config.specs import OptimSpec


def _params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(8, 4, generator=generator, dtype=dtype)),
            torch.nn.Parameter(torch.randn(4, generator=generator, dtype=dtype))]


def _spec(name: str, fused: bool = True) -> OptimSpec:
    if name == "adamw":
        return OptimSpec(name, weight_decay=0.1, fused=fused, impl="torch", distributed=False, betas=(0.9, 0.999), eps=1e-8)
    return OptimSpec(name, weight_decay=0.1, fused=fused, impl="torch", distributed=False, momentum=0.9)


def _trained(optim: OptimSpec, steps: int = 5) -> list[torch.Tensor]:
    params = _params()
    optimizer = build_optimizer(optim, params, lr=0.05)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_fused_kernel_is_the_default_and_matches_foreach(name: str) -> None:
    assert build_optimizer(_spec(name), _params(), lr=0.05).defaults["fused"] is True
    assert not build_optimizer(_spec(name, fused=False), _params(), lr=0.05).defaults.get("fused")
    for fused, foreach in zip(_trained(_spec(name)), _trained(_spec(name, fused=False))):
        torch.testing.assert_close(fused, foreach, rtol=1e-6, atol=1e-6)


def test_weight_decay_applies_to_matrices_only() -> None:
    matrix, bias = _params()
    decayed, plain = parameter_groups([matrix, bias], 0.1)
    assert decayed == {"params": [matrix], "weight_decay": 0.1}
    assert plain == {"params": [bias], "weight_decay": 0.0}


def test_unknown_optimizer_names_the_choices() -> None:
    with pytest.raises(ValueError, match="choose adamw or sgd"):
        build_optimizer(OptimSpec("lamb", weight_decay=0.0, fused=True, impl="torch", distributed=False), _params(), lr=0.1)
