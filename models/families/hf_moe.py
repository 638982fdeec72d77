"""The pipeline layers of a Hugging Face mixture-of-experts decoder (``MixtralForCausalLM``,
``Qwen2MoeForCausalLM``) under ``model=hf`` (``models.families.hf`` builds the rest).

Each MoE decoder layer is the model's own (attention, norms) with its MoE block replaced by
``models.families.moe.MoEMLP`` (so expert parallelism, the routing statistics and the exact
index_add combine are the llama family's), holding only this rank's experts, filled from the
checkpoint's per-expert tensors (``hf_moe_facts.moe_layer_keys``).

transformers' load-balancing loss is taken over all MoE layers' routing at once: num_experts *
sum_e (slots routed to e / rows) * (sum of e's router probability / rows), rows = MoE layers x
tokens, which is not the mean of per-layer losses. Its layers sit in different pipeline stages,
so the per-expert sums travel with the hidden states: every layer passes (hidden, slot counts
[E], probability shares [E]) on, each MoE layer adding its own, and the head computes the loss
from them. The counts are integers (no gradient; exact under any precision); the gradient flows
back to every layer's router through the shares, across the stage boundaries like the hidden
states' gradient (``models.boundary``). Under bf16 or fp16 the shares travel in that precision,
as every floating-point boundary does (``pipedream.numerics.precision``)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.expert_parallel import ExpertParallel
from models.group_context import splitting
from models.families.hf_layers import HFDecoderLayer, HFEmbedding, HFHead
from models.families.llama import SwiGLU
from models.families.moe import MoEMLP, MoEStatistics, attach_auxiliary_objective
from models.families.moe_facts import MoEConfig


class WholeModelMoEStatistics(MoEStatistics):
    """``MoEStatistics`` whose load-balancing loss is recorded once per micro-batch, by the head,
    for the whole model (``moe_aux_loss``: its mean over micro-batches); the MoE layers record
    only their slot counts."""

    def record_counts(self, counts: torch.Tensor) -> None:
        zero = torch.zeros((), dtype=torch.float64, device=counts.device)
        self.record(counts, zero, zero, zero)
        self._calls -= 1   # a call is one micro-batch's loss (the head's record), not a layer's counts


def counting_forward(module: nn.Module) -> bool:
    """A training forward counted once: not in evaluation, nor when a checkpoint recomputes the
    forward inside the backward (a graph task is running then)."""
    return module.training and torch._C._current_graph_task_id() == -1


Routing = tuple[torch.Tensor, torch.Tensor]   # (slot counts [E] int64, probability shares [E])


class HFRoutedMLP(MoEMLP):
    """An ``MoEMLP`` that leaves its load-balancing term to the head: each forward keeps, for its
    decoder layer, its per-expert slot counts (integers: exact whatever the precision, and without
    gradient) and its router probabilities summed over tokens / (MoE layers x tokens): summed over
    the layers, transformers' mean router probability per expert, a number at most one that a
    half-precision boundary carries without overflow."""

    routing: Routing | None = None

    def _with_auxiliary_objective(self, out: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor,
                                  slot_experts: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(slot_experts, minlength=self.moe.num_experts)
        if counting_forward(self):
            self.statistics.record_counts(counts)
        self.routing = (counts, probs.sum(dim=0) / (self.moe_layers * probs.shape[0]))
        return out


class HFMoEEmbedding(HFEmbedding):
    """The embedding, and the routing (zero) the MoE layers add to."""

    def __init__(self, *args: Any, num_experts: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.num_experts = num_experts

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = super().forward(tokens)
        return (hidden, hidden.new_zeros(self.num_experts, dtype=torch.int64),
                hidden.new_zeros(self.num_experts, dtype=torch.float32))


class HFMoEDecoderLayer(HFDecoderLayer):
    """A decoder layer taking and passing on (hidden, slot counts, probability shares); an MoE
    layer adds its own."""

    def forward(self, hidden: torch.Tensor, counts: torch.Tensor,
                shares: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mlp = self.layer.mlp
        if not isinstance(mlp, HFRoutedMLP):   # a dense layer (Qwen2-MoE's mlp_only_layers)
            return super().forward(hidden), counts, shares.view_as(shares)
        mlp.routing = None
        hidden = super().forward(hidden)
        added, mlp.routing = mlp.routing, None   # none on the meta device (shape inference)
        if added is None:
            return hidden, counts, shares.view_as(shares)
        return hidden, counts + added[0], shares + added[1].to(shares.dtype)


class HFMoEHead(HFHead):
    """The final norm and LM head; in training, transformers' load-balancing loss of the whole
    model from the routing, times ``router_aux_loss_coef``, joins the objective."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, moe: MoEConfig, moe_layers: int,
                 statistics: WholeModelMoEStatistics):
        super().__init__(norm, lm_head)
        self.moe, self.moe_layers, self.statistics = moe, moe_layers, statistics

    def forward(self, hidden: torch.Tensor, counts: torch.Tensor, shares: torch.Tensor) -> torch.Tensor:
        logits = super().forward(hidden)
        if hidden.is_meta:
            return logits
        rows = self.moe_layers * hidden.shape[0] * hidden.shape[1]
        aux = self.moe.num_experts * torch.sum((counts.float() / rows) * shares.float())
        if counting_forward(self):
            no_slots = torch.zeros(self.moe.num_experts, dtype=torch.int64, device=hidden.device)
            zero = torch.zeros((), dtype=torch.float64, device=hidden.device)
            self.statistics.record(no_slots, zero, aux, zero)
        if not (torch.is_grad_enabled() and self.training) or self.moe.aux_loss_coef == 0:
            return logits
        return attach_auxiliary_objective(logits, self.moe.aux_loss_coef * aux, self.statistics)


def routed_mlp(config: Any, moe: MoEConfig, statistics: WholeModelMoEStatistics, moe_layers: int,
               ep: ExpertParallel | None) -> HFRoutedMLP:
    """An MoE block holding this rank's experts, on the meta device: the caller materialises it
    (then fills it from the checkpoint), so the experts other ranks hold never take memory."""
    def linear(in_features: int, out_features: int) -> nn.Linear:   # its values come from the checkpoint
        return nn.Linear(in_features, out_features, bias=False)

    with torch.device("meta"):
        mlp = HFRoutedMLP(int(config.hidden_size), moe, statistics, moe_layers, SwiGLU, linear, ep=ep)
    return mlp


def mark_experts(mlp: nn.Module, ep: ExpertParallel | None) -> None:
    """After ``to_empty``, which makes new Parameters: mark the experts again for expert-parallel
    gradient reduction (``pipedream.numerics.expert_grads``), as ``MoEMLP`` marked them."""
    if splitting(ep) is None:
        return
    for param in mlp.experts.parameters():
        param.expert_parallel = True


def read_fused(tensors: dict[str, torch.Tensor], keys: dict[str, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """Local name -> its tensor: one stored tensor, or gate and up stacked by rows ([gate; up])."""
    return {local: tensors[names[0]] if len(names) == 1 else torch.cat([tensors[n] for n in names], dim=0)
            for local, names in keys.items()}
