"""A BERT encoder (bidirectional attention, learned positions, GELU MLP; post-LayerNorm as in
Devlin et al., or pre-LayerNorm) with a masked-language-model head tied to the token embedding,
as a list of layers: [embedding, block_0 .. block_{L-1}, MLM head]. Built dense, or with ``tp`` as
this rank's tensor-parallel slice of the same dense layers (vocabulary-parallel embedding, head
and loss; Megatron-split attention and MLP)."""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.tensor_parallel import (RNGTracker, ShardSpec, TensorParallel, VocabParallelEmbedding, mark_replicated,
                                       mark_sharded, parallelize_block, shard_tensor, vocab_parallel_cross_entropy,
                                       vocab_parallel_logits)

from models.families.transformer_facts import OPTIONAL_KEYS, mlm_mask_id, option, transformer_pipeline_layers
from models.families.gpt import INIT_STD, MLP, CausalSelfAttention, check_tensor_parallel, transformer_sizes
from models.spec import LayerModel, seeded

IGNORE_INDEX = -100  # MLM targets at positions that were not masked


class BertEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, seq_len: int, dropout: float):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(dropout)
        nn.init.normal_(self.wte.weight, std=INIT_STD)
        nn.init.normal_(self.wpe.weight, std=INIT_STD)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.ln(self.wte(tokens) + self.wpe(positions)))


class BertBlock(nn.Module):
    """Post-LN: x = LN(x + f(x)) (original BERT); pre-LN: x = x + f(LN(x)) (stabler when deep)."""

    def __init__(self, hidden: int, num_heads: int, dropout: float, pre_ln: bool):
        super().__init__()
        self.pre_ln = pre_ln
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, num_heads, dropout, INIT_STD, causal=False)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, dropout, INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_ln:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


class MLMHead(nn.Module):
    """[final LN when pre-LN] -> dense + GELU + LN (replicated) -> vocabulary projection with bias.
    ``weight`` is tied to the token embedding; with ``tp`` it and ``bias`` are vocabulary shards."""

    def __init__(self, vocab_size: int, hidden: int, pre_ln: bool):
        super().__init__()
        self.ln_f = nn.LayerNorm(hidden) if pre_ln else nn.Identity()
        self.dense = nn.Linear(hidden, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden))
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        self.tp: TensorParallel | None = None
        nn.init.normal_(self.dense.weight, std=INIT_STD)
        nn.init.zeros_(self.dense.bias)
        nn.init.normal_(self.weight, std=INIT_STD)

    def shard(self, tp: TensorParallel) -> "MLMHead":
        """Keeps only this rank's vocabulary slice of ``weight`` and ``bias``."""
        spec = ShardSpec(dim=0, full_size=self.weight.shape[0])
        self.weight = mark_sharded(nn.Parameter(shard_tensor(self.weight.detach(), spec, tp)), spec)
        self.bias = mark_sharded(nn.Parameter(shard_tensor(self.bias.detach(), spec, tp)), spec)
        self.tp = tp
        return mark_replicated(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(F.gelu(self.dense(self.ln_f(x))))
        if self.tp is None:
            return F.linear(h, self.weight, self.bias)
        return vocab_parallel_logits(h, self.weight, self.tp, self.bias)


def mlm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)


def parallel_mlm_loss(logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel, vocab_size: int) -> torch.Tensor:
    return vocab_parallel_cross_entropy(logits, targets, tp, vocab_size, ignore_index=IGNORE_INDEX)


def parallelize_bert_layer(layer: nn.Module, tp: TensorParallel, rng: RNGTracker) -> nn.Module:
    """This rank's slice of a dense BERT layer (see ``models.families.gpt.parallelize_gpt_layer``)."""
    if isinstance(layer, BertEmbedding):
        layer.wte = VocabParallelEmbedding.from_dense_weight(layer.wte.weight.detach(), tp)
        return mark_replicated(layer)
    if isinstance(layer, MLMHead):
        return layer.shard(tp)
    return parallelize_block(layer, tp, rng)


def bert_model(num_layers: int, hidden_size: int, num_heads: int, seq_len: int,
               vocab_size: int = OPTIONAL_KEYS["vocab_size"], tie_embeddings: bool = OPTIONAL_KEYS["tie_embeddings"],
               dropout: float = OPTIONAL_KEYS["dropout"], pre_ln: bool = OPTIONAL_KEYS["pre_ln"], seed: int = 0,
               tp: TensorParallel | None = None, mask_fraction: float = OPTIONAL_KEYS["mask_fraction"]) -> LayerModel:
    """BERT as ``num_layers + 2`` pipeline layers; inputs are corrupted tokens, targets the original
    ids at masked positions and -100 elsewhere (``pipedream.data.datasets.MaskedLanguageModeling``)."""
    last = num_layers + 1
    if tp is not None:
        check_tensor_parallel(hidden_size, num_heads, tp.size)

    def build_dense_layer(i: int) -> nn.Module:
        if i == 0:
            return seeded(seed, partial(BertEmbedding, vocab_size, hidden_size, seq_len, dropout))
        if i == last:
            head = seeded(seed + i, partial(MLMHead, vocab_size, hidden_size, pre_ln))
            if tie_embeddings:  # starts from the embedding's table, drawn from its seed
                with torch.no_grad():
                    head.weight.copy_(seeded(seed, partial(BertEmbedding, vocab_size, hidden_size, seq_len,
                                                           dropout)).wte.weight)
            return head
        return seeded(seed + i, partial(BertBlock, hidden_size, num_heads, dropout, pre_ln))

    def build_layer(i: int) -> nn.Module:
        dense = build_dense_layer(i)
        return dense if tp is None else parallelize_bert_layer(dense, tp, RNGTracker(seed + i, tp.rank))

    def make_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(vocab_size - 1, (batch_size, seq_len), generator=generator)
        masked = torch.rand(batch_size, seq_len, generator=generator) < mask_fraction
        masked[:, 0] = True  # at least one target per sample
        inputs = tokens.masked_fill(masked, mlm_mask_id(vocab_size))
        return inputs, tokens.masked_fill(~masked, IGNORE_INDEX)

    tied = (((0, "wte.weight"), (last, "weight")),) if tie_embeddings else ()
    loss_fn = mlm_loss if tp is None else partial(parallel_mlm_loss, tp=tp, vocab_size=vocab_size)
    return LayerModel(name="bert", num_layers=transformer_pipeline_layers(num_layers), build_layer=build_layer,
                      loss_fn=loss_fn, make_batch=make_batch, tied=tied)


def bert_from_config(model_cfg: Any, seed: int = 0, tp: TensorParallel | None = None) -> LayerModel:
    """``model=bert_*`` (``models.registry``)."""
    return bert_model(**transformer_sizes(model_cfg), seed=seed, tp=tp, pre_ln=bool(option(model_cfg, "pre_ln")),
                      mask_fraction=float(option(model_cfg, "mask_fraction")))
