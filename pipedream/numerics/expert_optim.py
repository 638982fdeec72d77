"""The distributed optimizer (zero1) under expert parallelism: the dense parameters sharded over
dp x cp as ``sharded_optim`` does, the experts whole.

Why not shard the experts too: the dp x cp ranks of a stage hold different experts (the
expert-parallel peers), so a shard of the flat order would mix them. Each rank updates its own
experts with a plain optimizer of the same kind; their parameter groups follow the dense ones in
``param_groups`` (the same dicts), so the learning-rate schedule and checkpoints see every
parameter, and ``state_dict`` is the whole-model form with the experts' entries after the dense ones.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedream.config.specs import OptimSpec
from pipedream.numerics.grad_buckets import assign_buckets
from pipedream.numerics.sharded_optim import ShardedOptimizer


class ShardedWithExperts(ShardedOptimizer):
    """``ShardedOptimizer`` over the dense groups, plus ``experts``: the optimizer of the expert groups."""

    def __init__(self, dense_groups: list[dict[str, Any]], experts: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        super().__init__(dense_groups, *args, **kwargs)
        self.dense_groups = len(self.param_groups)
        self.experts = experts
        self.param_groups.extend(experts.param_groups)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self._link()
        self.experts.step()
        super().step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)   # every group's parameters, the experts' too

    def state_bytes(self) -> int:
        return super().state_bytes() + sum(t.numel() * t.element_size() for s in self.experts.state.values()
                                           for t in s.values() if torch.is_tensor(t))

    def state_dict(self) -> dict[str, Any]:
        dense, experts, first = super().state_dict(), self.experts.state_dict(), len(self.params)
        return {"state": {**dense["state"], **{first + k: v for k, v in experts["state"].items()}},
                "param_groups": dense["param_groups"] + [{**g, "params": [first + i for i in g["params"]]}
                                                         for g in experts["param_groups"]]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The dense groups' entries to the shards, the rest to the experts' optimizer (keys as saved:
        positions, or the names DCP gives them)."""
        groups, state = state_dict["param_groups"], state_dict["state"]
        dense = {key for group in groups[:self.dense_groups] for key in group["params"]}
        super().load_state_dict({"state": {k: v for k, v in state.items() if k in dense},
                                 "param_groups": groups[:self.dense_groups]})
        self.experts.load_state_dict({"state": {k: v for k, v in state.items() if k not in dense},
                                      "param_groups": groups[self.dense_groups:]})
        self.param_groups[self.dense_groups:] = self.experts.param_groups   # load_state_dict made new dicts

    def _link(self) -> None:
        """The expert groups take the schedule's learning rate (the same dicts unless a load replaced them)."""
        for inner, outer in zip(self.experts.param_groups, self.param_groups[self.dense_groups:]):
            inner["lr"] = outer["lr"]


def build_sharded_with_experts(optim: OptimSpec, dense: list[nn.Parameter], experts: list[nn.Parameter], lr: float,
                               group: dist.ProcessGroup | None, dp: int, dp_rank: int,
                               bucket_bytes: int | None = None) -> ShardedWithExperts:
    """As ``optim.build_sharded_optimizer`` over ``dense``, the ``experts`` whole (module docstring)."""
    from pipedream.numerics.optim import optimizer_for_groups, parameter_groups
    buckets = [b.params for b in assign_buckets(dense, bucket_bytes)] if bucket_bytes else None
    build = lambda groups: optimizer_for_groups(optim, groups, lr)   # noqa: E731
    # no empty group (experts hold matrices only): DCP's flattened state names a group by its first parameter
    expert_groups = [g for g in parameter_groups(experts, optim.weight_decay) if g["params"]]
    return ShardedWithExperts(parameter_groups(dense, optim.weight_decay), build(expert_groups), lr, build, group,
                              dp, dp_rank, buckets, level=optim.zero)
