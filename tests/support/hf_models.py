"""Tiny random Hugging Face decoders saved as ``save_pretrained`` writes them, for ``model=hf``."""
from __future__ import annotations

from pathlib import Path

import torch

TINY_SIZES = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=32)
# what a run of these models overrides: data within their vocabulary, few tiny steps
HF_RUN = ["data=synthetic", "data.num_samples=256", "model.seq_len=16", "train.global_batch_size=8",
          "train.micro_batch_size=2", "train.warmup_steps=1", "train.eval_every=0", "train.eval_batches=1",
          "train.log_every=1", "train.progress=false", "train.timeout_s=60"]


# Mixture-of-experts decoders: 4 experts, top-2, a load-balancing coefficient large enough to move
# the routers; Qwen2-MoE's layer 1 dense (mlp_only_layers), its top-2 weights not renormalised
MOE_CONFIGS = {
    "mixtral": lambda transformers: transformers.MixtralConfig(
        intermediate_size=24, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        router_aux_loss_coef=0.05, tie_word_embeddings=False, **TINY_SIZES),
    "qwen2_moe": lambda transformers: transformers.Qwen2MoeConfig(
        intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
        num_experts_per_tok=2, mlp_only_layers=[1], router_aux_loss_coef=0.05, num_key_value_heads=2,
        tie_word_embeddings=False, **TINY_SIZES),
}


def _config(kind: str):
    import transformers
    if kind == "gpt2":
        # no dropout: a pipeline's random streams differ from one process's
        return transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=32, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    if kind in MOE_CONFIGS:
        return MOE_CONFIGS[kind](transformers)
    classes = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config}
    extra = dict(sliding_window=8) if kind == "mistral" else {}
    return classes[kind](intermediate_size=48, num_key_value_heads=2, tie_word_embeddings=kind == "qwen2",
                         **TINY_SIZES, **extra)


def save_tiny(kind: str, folder: Path, seed: int = 0, max_shard_size: str | None = "20KB") -> Path:
    """A random ``kind`` (llama, mistral, qwen2, gpt2, mixtral, qwen2_moe) model saved under
    ``folder`` (sharded by default)."""
    import transformers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32)
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), **extra)
    return folder
