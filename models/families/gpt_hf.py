"""The ``gpt`` family as a Hugging Face ``GPT2LMHeadModel`` (``python -m pipedream.export format=hf``).

The two compute the same function: pre-LayerNorm blocks (eps 1e-5), fused q/k/v in that order,
scaled dot-product causal attention, a 4h MLP, learned positions and a bias-free head (tied or
not). The one difference in defaults is the MLP's GELU: ``models.families.gpt`` uses the exact
(erf) GELU, GPT-2's checkpoints the tanh approximation, so the exported config sets
``activation_function="gelu"`` (the exact one). GPT-2's ``Conv1D`` stores its weight as
(in, out), the transpose of ``nn.Linear``'s.
"""
from __future__ import annotations

from typing import Any

import torch

from models.families.transformer_facts import option

# project block name -> GPT-2 name, and whether the weight is a Conv1D (transposed)
BLOCK_NAMES = {"ln1": ("ln_1", False), "attn.qkv": ("attn.c_attn", True), "attn.proj": ("attn.c_proj", True),
               "ln2": ("ln_2", False), "mlp.fc": ("mlp.c_fc", True), "mlp.proj": ("mlp.c_proj", True)}


def gpt2_config(model_cfg: Any) -> dict[str, Any]:
    dropout = float(option(model_cfg, "dropout"))
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu",
            "vocab_size": int(option(model_cfg, "vocab_size")), "n_positions": int(model_cfg["seq_len"]),
            "n_embd": int(model_cfg["hidden_size"]), "n_layer": int(model_cfg["num_layers"]),
            "n_head": int(model_cfg["num_heads"]), "n_inner": None, "layer_norm_epsilon": 1e-5,
            "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout,
            "tie_word_embeddings": bool(option(model_cfg, "tie_embeddings")), "bos_token_id": None,
            "eos_token_id": None, "dtype": "float32"}


def gpt_to_hf(model_state: dict[str, torch.Tensor], model_cfg: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``<layer>.<name>`` of a ``model=gpt*`` run -> GPT2LMHeadModel's names and layouts."""
    blocks = int(model_cfg["num_layers"])
    head = blocks + 1
    state = {"transformer.wte.weight": model_state["0.wte.weight"],
             "transformer.wpe.weight": model_state["0.wpe.weight"],
             "transformer.ln_f.weight": model_state[f"{head}.ln_f.weight"],
             "transformer.ln_f.bias": model_state[f"{head}.ln_f.bias"]}
    if not bool(option(model_cfg, "tie_embeddings")):
        state["lm_head.weight"] = model_state[f"{head}.weight"]
    for block in range(blocks):
        for ours, (theirs, conv1d) in BLOCK_NAMES.items():
            weight = model_state[f"{block + 1}.{ours}.weight"]
            state[f"transformer.h.{block}.{theirs}.weight"] = weight.t().contiguous() if conv1d else weight
            state[f"transformer.h.{block}.{theirs}.bias"] = model_state[f"{block + 1}.{ours}.bias"]
    return gpt2_config(model_cfg), state
