"""Llama (Touvron et al. 2023; Llama 3, Grattafiori et al. 2024) as a list of layers:
[embedding, block_0 .. block_{L-1}, head (final RMSNorm + vocabulary projection)].

Pre-RMSNorm blocks with rotary position embeddings, grouped-query attention and a SwiGLU MLP, no
biases. The arithmetic follows Hugging Face's ``LlamaForCausalLM`` (RMSNorm in fp32, the
rotate-half RoPE convention, Llama 3's frequency scaling), so weights map 1:1
(``models.families.llama_hf``). The gate and up projections are one fused GEMM ([gate; up]).
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import CoreAttention
from models.context_parallel import ContextParallel, global_positions
from models.group_context import splitting
from models.context_parallel.context import check_context_parallel_model
from models.errors import ConfigError
from models.expert_parallel import ExpertParallel
from models.families.gpt import language_model_loss, parallel_language_model_loss
from models.families.moe import MoEMLP, MoEStatistics
from models.families.moe_facts import MoEConfig, moe_config
from models.families.llama_facts import (OPTIONAL_KEYS, check_llama_tensor_parallel, kv_heads_per_rank,
                                         llama_option, rope_scaling)
from models.families.transformer_facts import transformer_pipeline_layers
from models.spec import LayerModel, seeded
from models.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, ShardSpec, TensorParallel,
                                    VocabParallelEmbedding, mark_replicated, mark_sharded, shard_tensor,
                                    vocab_parallel_logits)
from models.tensor_parallel.gqa import ReplicatedHeadLinear
from models.tensor_parallel.sequence import sequence_parallel_weight

INIT_STD = 0.02  # Hugging Face's initializer_range: every matrix drawn N(0, 0.02^2), norms at one


def _linear(in_features: int, out_features: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=False)
    nn.init.normal_(layer.weight, std=INIT_STD)
    return layer


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, float] | None) -> torch.Tensor:
    """theta^(-2i/d) for each pair of features; with Llama 3's scaling, wavelengths beyond the
    original context / low_freq_factor slow down by ``factor``, those below / high_freq_factor
    stay, and the band between is interpolated smoothly."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < context / high) * ~(wavelength > context / low)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) computed in fp32, cast back, then scaled by the weight.
    ``sequence_parallel`` (a tensor-parallel group): it normalises this rank's part of the sequence,
    so the weight's gradient is summed over the group."""

    sequence_parallel: TensorParallel | None = None

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight if self.sequence_parallel is None else \
            sequence_parallel_weight(self.weight, self.sequence_parallel)
        return weight * normed.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary embeddings. ``num_heads`` / ``num_kv_heads``
    are the heads this module computes: all of them dense, this rank's under tensor parallelism.
    ``cp``: x is this rank's zigzag shard of the sequence; rotary at its global positions, ring attention."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, inv_freq: torch.Tensor,
                 cp: ContextParallel | None = None):
        super().__init__()
        self.head_dim = hidden // num_heads
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.q_proj = _linear(hidden, num_heads * self.head_dim)
        self.k_proj = _linear(hidden, num_kv_heads * self.head_dim)
        self.v_proj = _linear(hidden, num_kv_heads * self.head_dim)
        self.o_proj = _linear(num_heads * self.head_dim, hidden)
        self.core = CoreAttention(causal=True, cp=cp)   # grouped-query when k and v have fewer heads
        self.cp = cp
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotary(self, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        positions = global_positions(seq, self.cp, device).to(torch.float32)
        freqs = positions[:, None] * self.inv_freq.to(device=device, dtype=torch.float32)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x)   # the whole sequence (with sequence parallelism x holds this rank's part)
        batch, seq = q.shape[:2]
        q = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(seq, x.device)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = self.core(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up computed as one GEMM."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_up_proj = _linear(hidden, 2 * ffn)
        self.down_proj = _linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """``mlp``: a block's MLP other than the dense SwiGLU (an MoE MLP, ``models.families.moe``)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, ffn: int, eps: float,
                 inv_freq: torch.Tensor, cp: ContextParallel | None = None,
                 mlp: Callable[[], nn.Module] | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, num_heads, num_kv_heads, inv_freq, cp)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = SwiGLU(hidden, ffn) if mlp is None else mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden)
        nn.init.normal_(self.embed_tokens.weight, std=INIT_STD)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)


class Head(nn.Module):
    """The final RMSNorm and the projection to vocabulary logits (``weight``, tieable)."""

    def __init__(self, vocab_size: int, hidden: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden))
        nn.init.normal_(self.weight, std=INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.weight)


class ParallelHead(nn.Module):
    """The replicated final RMSNorm, then this rank's slice of the (padded) vocabulary; the
    logits stay split for ``vocab_parallel_cross_entropy``."""

    def __init__(self, head: Head, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.norm = head.norm
        if tp.sequence_parallel:   # on this rank's part of the sequence; the logits gather it
            self.norm.sequence_parallel = tp
        spec = ShardSpec(dim=0, full_size=head.weight.shape[0])
        self.weight = mark_sharded(nn.Parameter(shard_tensor(head.weight.detach(), spec, tp)), spec)
        mark_replicated(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(self.norm(x), self.weight, self.tp)


def parallelize_block(block: Block, tp: TensorParallel) -> Block:
    """Megatron's split in place: column-parallel Q, K, V (whole heads per rank; key/value heads
    replicated when fewer than ranks) and [gate; up], row-parallel O and down; RMSNorms replicated."""
    attn = block.self_attn
    kv_local = kv_heads_per_rank(attn.num_heads, attn.num_kv_heads, tp.size)
    if attn.num_kv_heads % tp.size == 0:
        attn.k_proj = ColumnParallelLinear.from_dense(attn.k_proj, tp)
        attn.v_proj = ColumnParallelLinear.from_dense(attn.v_proj, tp)
    else:
        attn.k_proj = ReplicatedHeadLinear(attn.k_proj.weight, attn.num_kv_heads, tp)
        attn.v_proj = ReplicatedHeadLinear(attn.v_proj.weight, attn.num_kv_heads, tp)
    attn.q_proj = ColumnParallelLinear.from_dense(attn.q_proj, tp)
    attn.o_proj = RowParallelLinear.from_dense(attn.o_proj, tp)
    attn.num_heads, attn.num_kv_heads = attn.num_heads // tp.size, kv_local
    block.mlp.gate_up_proj = ColumnParallelLinear.from_dense(block.mlp.gate_up_proj, tp, stride=2)
    block.mlp.down_proj = RowParallelLinear.from_dense(block.mlp.down_proj, tp)
    if tp.sequence_parallel:   # the RMSNorms run on this rank's part of the sequence
        block.input_layernorm.sequence_parallel = block.post_attention_layernorm.sequence_parallel = tp
    return mark_replicated(block)


def parallelize_llama_layer(layer: nn.Module, tp: TensorParallel) -> nn.Module:
    """This rank's slice of a dense layer (a model too big for one device would initialise the
    shards directly instead)."""
    if isinstance(layer, Embedding):
        layer.embed_tokens = VocabParallelEmbedding.from_dense_weight(layer.embed_tokens.weight.detach(), tp)
        return mark_replicated(layer)
    if isinstance(layer, Head):
        return ParallelHead(layer, tp)
    return parallelize_block(layer, tp)


def llama_model(num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int, ffn_hidden_size: int,
                seq_len: int, vocab_size: int, tie_embeddings: bool = OPTIONAL_KEYS["tie_embeddings"],
                norm_eps: float = OPTIONAL_KEYS["norm_eps"], rope_theta: float = OPTIONAL_KEYS["rope_theta"],
                rope_scaling: dict[str, float] | None = None, seed: int = 0,
                tp: TensorParallel | None = None, cp: ContextParallel | None = None,
                moe: MoEConfig | None = None, ep: ExpertParallel | None = None) -> LayerModel:
    """Llama as ``num_layers + 2`` pipeline layers, each initialised from its own seed. With tying
    the head starts from (and stays equal to) the token embedding; with ``tp`` every layer is
    this rank's slice of the dense layer and the loss is the vocabulary-parallel cross-entropy.
    With ``cp`` (size > 1) the layers take this rank's zigzag shard of each sequence; the same
    parameters, and the loss is the local mean. With ``moe`` its MoE blocks (``MoEConfig.is_moe_block``)
    hold an MoE MLP; they report to the model's ``statistics`` (``models.families.moe``); with ``ep``
    (size > 1) each holds this rank's experts and exchanges tokens over the expert-parallel group."""
    last = num_layers + 1
    if tp is not None:
        check_llama_tensor_parallel({"hidden_size": hidden_size, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
                                     "ffn_hidden_size": ffn_hidden_size}, tp.size)
    cp = splitting(cp)
    if cp is not None:
        check_context_parallel_model(cp, 1 if tp is None else tp.size, seq_len,
                                     sequence_parallel=tp is not None and tp.sequence_parallel)
    inv_freq = rope_inverse_frequencies(hidden_size // num_heads, rope_theta, rope_scaling)
    embedding = partial(Embedding, vocab_size, hidden_size)
    statistics = None
    if moe is not None:
        if tp is not None:
            raise ConfigError(f"model.moe has no tensor-parallel form but parallel.tp={tp.size}: set parallel.tp=1")
        statistics = MoEStatistics(moe.num_experts)
        moe_mlp = partial(MoEMLP, hidden_size, moe, statistics, moe.moe_blocks(num_layers), SwiGLU, _linear, ep=ep)

    def build_dense_layer(i: int) -> nn.Module:
        if i == 0:
            return seeded(seed, embedding)
        if i == last:
            head = seeded(seed + i, partial(Head, vocab_size, hidden_size, norm_eps))
            if tie_embeddings:  # same values as the embedding's table, drawn from its seed
                with torch.no_grad():
                    head.weight.copy_(seeded(seed, embedding).embed_tokens.weight)
            return head
        mlp = moe_mlp if moe is not None and moe.is_moe_block(i - 1) else None
        return seeded(seed + i, partial(Block, hidden_size, num_heads, num_kv_heads, ffn_hidden_size, norm_eps,
                                        inv_freq.clone(), cp, mlp))

    def build_layer(i: int) -> nn.Module:
        dense = build_dense_layer(i)
        return dense if tp is None else parallelize_llama_layer(dense, tp)

    def make_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(vocab_size, (batch_size, seq_len + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    tied = (((0, "embed_tokens.weight"), (last, "weight")),) if tie_embeddings else ()
    loss_fn = language_model_loss if tp is None else partial(parallel_language_model_loss, tp=tp,
                                                             vocab_size=vocab_size)
    return LayerModel(name="llama", num_layers=transformer_pipeline_layers(num_layers), build_layer=build_layer,
                      loss_fn=loss_fn, make_batch=make_batch, tied=tied, statistics=statistics)


def llama_sizes(model_cfg: Any) -> dict[str, Any]:
    """``llama_model``'s keyword arguments from a ``model`` config."""
    return dict(num_layers=int(model_cfg["num_layers"]), hidden_size=int(model_cfg["hidden_size"]),
                num_heads=int(model_cfg["num_heads"]), num_kv_heads=int(model_cfg["num_kv_heads"]),
                ffn_hidden_size=int(model_cfg["ffn_hidden_size"]), seq_len=int(model_cfg["seq_len"]),
                vocab_size=int(model_cfg["vocab_size"]),
                tie_embeddings=bool(llama_option(model_cfg, "tie_embeddings")),
                norm_eps=float(llama_option(model_cfg, "norm_eps")),
                rope_theta=float(llama_option(model_cfg, "rope_theta")), rope_scaling=rope_scaling(model_cfg),
                moe=moe_config(model_cfg))


def llama_from_config(model_cfg: Any, seed: int = 0, tp: TensorParallel | None = None,
                      cp: ContextParallel | None = None, ep: ExpertParallel | None = None) -> LayerModel:
    """``model=llama_*`` (``models.registry``)."""
    return llama_model(**llama_sizes(model_cfg), seed=seed, tp=tp, cp=cp, ep=ep)
