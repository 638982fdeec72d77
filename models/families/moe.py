"""Mixture-of-experts MLPs for the Llama family (``model.moe``, ``models.families.moe_facts``).

``MoEMLP``: a router (Linear hidden -> num_experts, no bias), a softmax over the experts and each
token's top_k of it (renormalised to sum to one with ``renormalize``, as Mixtral; Qwen1.5-MoE
keeps the raw probabilities), SwiGLU experts run one after another on the tokens routed to each
(index_select in, index_add out: exact and deterministic), optional shared experts every token
goes through (scaled by a sigmoid gate with ``shared_expert_gate``), and with ``capacity_factor``
at most ``capacity`` token-slots per expert, the overflow dropped by token order.
With expert parallelism (``models.expert_parallel``) a rank holds ``num_experts / ep`` of the
experts and the routed token-slots travel to their experts' ranks and back by all-to-all.

The auxiliary objective of one MoE layer, per micro-batch, is ``(aux_loss_coef * aux + z_loss_coef
* z) / moe_layers``: aux is Switch/Mixtral's load-balancing loss ``num_experts * sum_e f_e P_e``
(f_e: token-slots routed to e per token, before any drop; P_e: e's mean router probability), as
transformers' ``load_balancing_loss_func`` computes it for one layer; z is the router z-loss
mean(logsumexp(logits)^2). Dividing by the number of MoE layers makes the model's auxiliary term
their mean, the magnitude transformers' loss over all layers has. It reaches the gradients in
whichever pipeline stage the layer sits: ``_WithAuxiliaryObjective`` passes the MLP's output
through and, in the backward, adds the objective's gradient times the factor the runtime
multiplies that micro-batch's loss by (``MoEStatistics.loss_scale``: 1/m, times fp16's loss
scale), as Megatron-Core's ``MoEAuxLossAutoScaler``. So training minimises the mean over
micro-batches of (loss + auxiliary objective).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from typing import Callable

from models.expert_parallel import ExchangeTally, ExpertParallel, exchange_counts, start_exchange
from models.group_context import splitting
from models.families.moe_facts import MoEConfig


class MoEStatistics:
    """One per built model, shared by its MoE MLPs: the runtime sets ``loss_scale`` before each
    forward (``Stage.forward``) and reads the routing counts at logged steps (``sums``, summed over
    ranks, then ``report``). ``collected``: a list makes the layers append their auxiliary objective
    (with its graph) there instead of adding its gradient themselves, for a loop that adds it to
    the loss explicitly (the single-process reference of the tests)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.loss_scale = 1.0
        self.collected: list[torch.Tensor] | None = None
        self.exchange = ExchangeTally()   # expert parallelism's all-to-alls over the run (not reset)
        self.reset()

    def reset(self) -> None:
        self._counts: torch.Tensor | None = None   # token-slots per expert, over layers and micro-batches
        self._dropped: torch.Tensor | None = None
        self._aux: torch.Tensor | None = None      # sums of each layer call's aux and z losses
        self._z: torch.Tensor | None = None
        self._calls = 0                            # MoE layer forwards counted

    def record(self, counts: torch.Tensor, dropped: torch.Tensor, aux: torch.Tensor, z: torch.Tensor) -> None:
        # kept on the device as tensors: no synchronisation until the logged step reads them
        values = (counts, dropped, aux.detach().double(), z.detach().double())
        if self._counts is None:
            self._counts, self._dropped, self._aux, self._z = values
        else:
            self._counts, self._dropped = self._counts + counts, self._dropped + dropped
            self._aux, self._z = self._aux + values[2], self._z + values[3]
        self._calls += 1

    def sums(self) -> list[float]:
        """This process's [tokens per expert..., dropped, aux sum, z sum, layer calls] since the last
        call (then reset): the same length on every rank, so ranks sum them elementwise."""
        if self._counts is None:
            values = [0.0] * (self.num_experts + 4)
        else:
            tensors = torch.cat([self._counts.double(), self._dropped.double().view(1), self._aux.view(1),
                                 self._z.view(1)])
            values = [*tensors.tolist(), float(self._calls)]
        self.reset()
        return values

    def report(self, sums: list[float]) -> dict[str, object]:
        """metrics.jsonl's MoE fields from ``sums`` added over every rank: token-slots per expert
        summed over the MoE layers and micro-batches since the previous logged step, the slots dropped
        for capacity, and the mean over layers and micro-batches of the load-balancing and z losses."""
        experts = self.num_experts
        calls = sums[experts + 3]
        mean = (lambda value: value / calls) if calls else (lambda value: float("nan"))
        return {"moe_tokens_per_expert": [int(c) for c in sums[:experts]], "moe_tokens_dropped": int(sums[experts]),
                "moe_aux_loss": mean(sums[experts + 1]), "moe_z_loss": mean(sums[experts + 2])}


class _WithAuxiliaryObjective(torch.autograd.Function):
    """Identity on ``output``; its backward also sends ``scale`` as the gradient of ``objective``."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, objective: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.objective_meta = (objective.shape, objective.dtype, objective.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        shape, dtype, device = ctx.objective_meta
        return grad_output, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def attach_auxiliary_objective(out: torch.Tensor, objective: torch.Tensor, statistics: MoEStatistics) -> torch.Tensor:
    """``out``, whose backward also sends the gradient of ``objective`` (times the micro-batch's loss
    scale); with ``statistics.collected`` the objective goes there instead, for a loop adding it
    to the loss itself (the llama family's layers do the same in ``_with_auxiliary_objective``)."""
    if statistics.collected is not None:
        statistics.collected.append(objective)
        return out
    return _WithAuxiliaryObjective.apply(out, objective, statistics.loss_scale)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(softmax probabilities [T, E] in fp32, each token's top_k weights [T, k], their experts [T, k])."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights, experts


def capacity_keep(experts: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """Which token-slots ([T * k], token-major) their expert takes: all when dropless, else each
    expert's first ``capacity`` slots in token order."""
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    position = F.one_hot(experts, num_experts).cumsum(dim=0).gather(1, experts[:, None]).squeeze(1) - 1
    return position < capacity


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """num_experts * sum_e f_e P_e, f_e = slots routed to e / tokens, P_e = mean probability of e
    (transformers' ``load_balancing_loss_func`` on one layer without an attention mask)."""
    tokens = probs.shape[0]
    f = torch.bincount(experts.reshape(-1), minlength=num_experts).to(probs.dtype) / tokens
    return num_experts * torch.sum(f * probs.mean(dim=0))


class ExpertDict(nn.ModuleDict):
    """A rank's experts under their global indices (``experts[5]`` or ``experts["5"]``): the names
    of their parameters are those of the whole model whichever rank holds them."""

    def __getitem__(self, key: int | str) -> nn.Module:
        return super().__getitem__(str(key))


class MoEMLP(nn.Module):
    """The MoE MLP of one block (module docstring). ``moe_layers``: MoE blocks in the model (the
    auxiliary objective is their mean). ``expert(hidden, ffn)`` builds one SwiGLU and ``linear(in,
    out)`` one bias-free Linear, each initialised as the family initialises them. With ``ep`` (an
``ExpertParallel`` of size > 1) this rank holds only its experts, under their global indices
(``experts.5.…``), so checkpoints and the names of every parameter are those of the whole model."""

    def __init__(self, hidden: int, moe: MoEConfig, statistics: MoEStatistics, moe_layers: int,
                 expert: Callable[[int, int], nn.Module], linear: Callable[[int, int], nn.Module],
                 ep: ExpertParallel | None = None):
        super().__init__()
        self.moe, self.statistics, self.moe_layers = moe, statistics, moe_layers
        self.ep = splitting(ep)
        self.router = linear(hidden, moe.num_experts)
        mine = range(moe.num_experts) if self.ep is None else self.ep.local_experts(moe.num_experts)
        # every expert is drawn, in order, so each starts from the values it has at ep = 1
        experts = {str(e): expert(hidden, moe.expert_ffn) for e in range(moe.num_experts)}
        self.experts = ExpertDict({str(e): experts[str(e)] for e in mine})
        if self.ep is not None:   # reduced over the ranks holding the same experts (pipedream.numerics.expert_grads)
            for param in self.experts.parameters():
                param.expert_parallel = True
        self.shared = expert(hidden, moe.shared_experts * moe.shared_ffn) if moe.shared_experts else None
        self.shared_gate = linear(hidden, 1) if moe.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.router(tokens)
        if x.device.type == "meta":
            return self._shapes_only(tokens).view_as(x)
        probs, weights, experts = route(logits, moe.top_k, moe.renormalize)
        slot_experts = experts.reshape(-1)   # token-major: token t's slots are t*k .. t*k + k - 1
        keep = capacity_keep(slot_experts, moe.num_experts, moe.capacity(tokens.shape[0]))
        slot_tokens = torch.arange(tokens.shape[0], device=x.device).repeat_interleave(moe.top_k)
        slot_weights = weights.reshape(-1).to(x.dtype)
        if self.ep is None:
            out = self._local_experts(tokens, slot_experts, keep, slot_tokens, slot_weights)
            shared = self._shared_output(tokens)
        else:
            out, shared = self._exchanged_experts(tokens, slot_experts, keep, slot_tokens, slot_weights)
        if shared is not None:
            out = out + shared.to(out.dtype)
        out = out.view_as(x)
        return self._with_auxiliary_objective(out, logits, probs, slot_experts, keep)

    def _local_experts(self, tokens: torch.Tensor, slot_experts: torch.Tensor, keep: torch.Tensor,
                       slot_tokens: torch.Tensor, slot_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(tokens)
        # every expert runs, on no rows if no token chose it: each of its parameters then takes one
        # gradient per micro-batch (a zero one), the count the overlapped reduction's buckets expect
        for e, expert in self.experts.items():
            slots = torch.nonzero((slot_experts == int(e)) & keep).squeeze(1)
            rows = slot_tokens.index_select(0, slots)   # distinct tokens: one slot per (token, expert)
            y = expert(tokens.index_select(0, rows)) * slot_weights.index_select(0, slots)[:, None]
            out = out.index_add(0, rows, y.to(out.dtype))
        return out

    def _exchanged_experts(self, tokens: torch.Tensor, slot_experts: torch.Tensor, keep: torch.Tensor,
                           slot_tokens: torch.Tensor, slot_weights: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The routed experts over the expert-parallel group, and the shared experts computed while
        the tokens travel. Rows go out grouped by expert (so by rank), each expert's in token order;
        a rank runs each (source rank, expert) block through the expert as it arrives, sends the
        results back in the same order, and the source adds them expert by expert in index order,
        as ``_local_experts`` does: the same per-row arithmetic and order of accumulation."""
        ep, num_experts = self.ep, self.moe.num_experts
        per_rank = num_experts // ep.size
        slots = [torch.nonzero((slot_experts == e) & keep).squeeze(1) for e in range(num_experts)]
        counts = torch.bincount(slot_experts[keep], minlength=num_experts).view(ep.size, per_rank)
        tally = self.statistics.exchange
        received = exchange_counts(counts, ep, tally)
        send, receive = counts.sum(1).tolist(), received.sum(1).tolist()
        order = torch.cat(slots)
        rows = slot_tokens.index_select(0, order)
        finish = start_exchange(tokens.index_select(0, rows), send, receive, ep, tally, "dispatch")
        shared = self._shared_output(tokens)   # overlaps the dispatch
        arrived = finish()
        blocks = arrived.split(received.flatten().tolist())
        local = list(self.experts.values())
        # every block runs, empty or not: an expert's parameters take one gradient per source rank and
        # micro-batch (as ``_local_experts``), and an empty result still joins the graph, so the
        # backward's exchange runs on every rank
        outputs = [local[i % per_rank](block) for i, block in enumerate(blocks)]
        results = torch.cat(outputs).to(tokens.dtype)
        back = start_exchange(results, receive, send, ep, tally, "combine")()
        y = back * slot_weights.index_select(0, order)[:, None]
        out = torch.zeros_like(tokens)
        start = 0
        for count in counts.flatten().tolist():   # expert by expert, in index order
            if count:
                out = out.index_add(0, rows[start:start + count], y[start:start + count].to(out.dtype))
                start += count
        return out, shared

    def _shared_output(self, tokens: torch.Tensor) -> torch.Tensor | None:
        if self.shared is None:
            return None
        shared = self.shared(tokens)
        return shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(tokens)) * shared

    def _shapes_only(self, tokens: torch.Tensor) -> torch.Tensor:
        """On the meta device (shape inference, FLOP counting) routing has no values: every token
        goes through the first top_k experts, the shapes and GEMMs of a routed forward."""
        local = list(self.experts.values())   # with ep, this rank's experts only: no exchange here
        out = sum(local[i % len(local)](tokens) for i in range(self.moe.top_k))
        shared = self._shared_output(tokens)
        return out if shared is None else out + shared

    def _with_auxiliary_objective(self, out: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor,
                                  slot_experts: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        moe, statistics = self.moe, self.statistics
        aux = load_balancing_loss(probs, slot_experts, moe.num_experts)
        z = torch.logsumexp(logits.float(), dim=-1).square().mean()
        # counted once per training forward: not in evaluation, nor when a checkpoint recomputes the
        # forward inside the backward (a graph task is running then)
        if self.training and torch._C._current_graph_task_id() == -1:
            counts = torch.bincount(slot_experts, minlength=moe.num_experts)
            statistics.record(counts, (~keep).sum(), aux, z)
        if not (torch.is_grad_enabled() and self.training) or (moe.aux_loss_coef == 0 and moe.z_loss_coef == 0):
            return out
        objective = (moe.aux_loss_coef * aux + moe.z_loss_coef * z) / self.moe_layers
        if statistics.collected is not None:
            statistics.collected.append(objective)
            return out
        return _WithAuxiliaryObjective.apply(out, objective, statistics.loss_scale)
