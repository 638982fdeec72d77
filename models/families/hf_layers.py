"""The pipeline layers ``models.families.hf`` cuts a Hugging Face decoder into: the embedding (+
learned positions), one decoder layer with its own positions, rotary tables and mask, and the head
(final norm + LM head). ``models.families.hf_moe`` extends them for mixture-of-experts decoders."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.context_parallel import ContextParallel, global_positions


class HFEmbedding(nn.Module):
    """Token embedding, plus a learned position table where the model has one (GPT-2), read at
    the tokens' global positions (``cp``: this rank's zigzag shard)."""

    def __init__(self, embed: nn.Module, positions: nn.Module | None, dropout: nn.Module | None,
                 cp: ContextParallel | None = None):
        super().__init__()
        self.embed = embed
        self.positions = positions
        self.drop = dropout if dropout is not None else nn.Identity()
        self.cp = cp

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        if self.positions is not None:
            hidden = hidden + self.positions(global_positions(tokens.shape[1], self.cp, tokens.device))
        return self.drop(hidden)


class HFDecoderLayer(nn.Module):
    """One decoder layer; computes its own positions, rotary cos/sin and causal (or sliding-window) mask
    the way the model's own forward does for a batch without padding. ``cp``: ``hidden`` is this
    rank's zigzag shard, at its global positions; the ring attention masks, so no mask is built."""

    def __init__(self, layer: nn.Module, config: Any, rotary: nn.Module | None, sliding: bool,
                 cp: ContextParallel | None = None):
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self.sliding = sliding
        self.cp = cp
        self._config = config   # not a module: kept out of the state dict

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
        positions = global_positions(hidden.shape[1], self.cp, hidden.device).unsqueeze(0)
        make_mask = create_sliding_window_causal_mask if self.sliding else create_causal_mask
        # shape inference runs on the meta device, where a mask cannot be built (nor changes a shape);
        # under context parallelism the ring attention masks
        unmasked = hidden.is_meta or self.cp is not None
        mask = None if unmasked else make_mask(config=self._config, inputs_embeds=hidden, attention_mask=None,
                                               cache=None, position_ids=positions)
        extra = {}
        if self.rotary is not None:
            extra = dict(position_embeddings=self.rotary(hidden, positions), position_ids=positions)
        return self.layer(hidden, attention_mask=mask, **extra)


class HFHead(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def sliding_layer(config: Any, index: int) -> bool:
    """Whether decoder layer ``index`` attends through a sliding window (Mistral; Qwen2's layer_types)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[index] == "sliding_attention"
    return getattr(config, "sliding_window", None) is not None
