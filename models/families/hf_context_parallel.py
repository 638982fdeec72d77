"""``model=hf`` decoders with context parallelism: each rank holds its zigzag shard of every
sequence (``models.context_parallel``), so positions (learned or rotary) are the global ones and
the attention inside each ``transformers`` layer runs through ring attention.

``transformers`` looks the attention function up by the name in the layer's config
(``config._attn_implementation``) and calls it with the attention module, so every
context-parallel layer gets its own copy of the config naming ``RING_ATTENTION`` and a
``CoreAttention`` over its group, which the function finds on the module (selective recomputation
finds it there too). The causal mask is not built: the ring applies it."""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from models.attention import CoreAttention
from models.context_parallel import ContextParallel
from models.context_parallel.context import check_context_parallel_model
from models.errors import ConfigError

RING_ATTENTION = "context_parallel_ring"   # the name registered in transformers' AttentionInterface
CORE = "context_parallel_core"             # the attribute holding the CoreAttention on an attention module


def ring_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: query [b, heads, s, d], key/value [b, kv_heads, s, d] of
    this rank's shard; returns [b, s, heads, d] as transformers' own functions do."""
    return getattr(module, CORE)(query, key, value).transpose(1, 2).contiguous(), None


def check_hf_context_parallel(config: Any, num_layers: int, seq_len: int, cp: ContextParallel, where: str,
                              sliding: Any) -> None:
    """One-line ConfigErrors for what ring attention cannot compute: sliding windows, attention
    dropout, a softmax scale other than 1/sqrt(head_dim) (GPT-2's options)."""
    check_context_parallel_model(cp, 1, seq_len)
    windowed = [i for i in range(num_layers) if sliding(config, i)]
    if windowed:
        raise ConfigError(f"{where}decoder layer {windowed[0]} attends through a sliding window, which context "
                          f"parallelism's ring attention does not implement: use cp=1 or a model with full attention")
    dropout = float(getattr(config, "attention_dropout", 0.0) or getattr(config, "attn_pdrop", 0.0) or 0.0)
    if dropout > 0.0:
        raise ConfigError(f"{where}attention dropout {dropout} (config.json) with context parallelism cp={cp.size}: "
                          f"ring attention has no dropout; use cp=1 or save the model with attention dropout 0")
    if getattr(config, "scale_attn_weights", True) is False or getattr(config, "scale_attn_by_inverse_layer_idx",
                                                                          False):
        raise ConfigError(f"{where}scale_attn_weights=false or scale_attn_by_inverse_layer_idx=true (config.json): "
                          f"ring attention scales scores by 1/sqrt(head_dim) only; use cp=1")


def use_ring_attention(attention: nn.Module, cp: ContextParallel) -> None:
    """Makes ``attention`` (a transformers attention module) attend through the ring over ``cp``."""
    from transformers import AttentionInterface
    AttentionInterface.register(RING_ATTENTION, ring_attention_forward)   # idempotent: always this function
    attention.config = copy.deepcopy(attention.config)   # this layer's own: the others keep theirs
    attention.config._attn_implementation = RING_ATTENTION
    setattr(attention, CORE, CoreAttention(causal=True, cp=cp))
