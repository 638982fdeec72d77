"""What a model config implies, computed in one place: pipeline layers, parameters, FLOPs and the
reserved [MASK] id. The runtime (run spec, plan files, metrics) and the planner's analytic specs
all read these, so a plan made for a model always describes the model the trainer builds.

Torch-free: ``model_cfg`` is the Hydra ``model`` group or any mapping with the same keys.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

from models.formulas import gpt_flops_per_iteration, gpt_parameters, mlp_flops_per_iteration
from models.vision_facts import VISION_MODELS, vision_forward_flops_per_sample, vision_layers, vision_parameters

TRANSFORMERS = ("gpt", "bert")
EMBEDDING_AND_HEAD = 2  # a transformer's pipeline layers beyond its blocks
# The keys a transformer's config may leave out, and what leaving one out means (the presets in
# conf/model/ state them; hand-written mappings, e.g. in tests, may not). Read through ``option``.
OPTIONAL_KEYS = MappingProxyType({"vocab_size": 256, "tie_embeddings": True, "dropout": 0.0, "pre_ln": False,
                                  "mask_fraction": 0.15})


def option(model_cfg: Mapping[str, Any], key: str) -> Any:
    """``model_cfg[key]``, or its meaning when left out (``OPTIONAL_KEYS``)."""
    return model_cfg.get(key, OPTIONAL_KEYS[key])


def transformer_pipeline_layers(num_blocks: int) -> int:
    """[embedding, block_0 .. block_{L-1}, head]: the layer list ``models.gpt`` / ``models.bert`` build."""
    return num_blocks + EMBEDDING_AND_HEAD


def pipeline_layer_count(model_cfg: Mapping[str, Any]) -> int:
    """Layers a pipeline splits: blocks plus embedding and head for GPT and BERT; VGG-16 and
    ResNet-50 their fixed layer lists (``vision_facts``); the MLP its ``num_layers`` blocks."""
    if model_cfg["name"] in VISION_MODELS:
        return len(vision_layers(model_cfg))
    blocks = int(model_cfg["num_layers"])
    return transformer_pipeline_layers(blocks) if model_cfg["name"] in TRANSFORMERS else blocks


def transformer_parameters(family: str, num_layers: int, hidden: int, vocab: int, seq_len: int,
                           tie_embeddings: bool = True, pre_ln: bool = False) -> int:
    """Parameters of the dense ``models.gpt`` / ``models.bert`` model, each tied tensor counted once.

    Eq. 4.3 (``gpt_parameters``) counts blocks, token and position embeddings; GPT adds its final
    LayerNorm; BERT adds the embedding LayerNorm and the MLM head (dense h x h, LayerNorm, vocabulary
    bias, and a final LayerNorm when pre-LN). An untied head adds its own V x h matrix.
    """
    h = hidden
    total = gpt_parameters(num_layers, h, vocab, seq_len)
    if family == "gpt":
        total += 2 * h
    elif family == "bert":
        total += 2 * h + (h * h + h) + 2 * h + vocab + (2 * h if pre_ln else 0)
    else:
        raise ValueError(f"{family!r} is not a transformer family; choose one of {TRANSFORMERS}")
    return total + (0 if tie_embeddings else vocab * h)


def mlp_parameters(num_layers: int, hidden: int) -> int:
    """``models.mlp``: two h x h Linear layers with biases per residual block."""
    return num_layers * 2 * (hidden * hidden + hidden)


def parameter_count(model_cfg: Mapping[str, Any]) -> int:
    """Parameters of the model ``models.build_model(model_cfg)`` builds (dense, tp = 1)."""
    name = model_cfg["name"]
    if name in TRANSFORMERS:
        return transformer_parameters(name, int(model_cfg["num_layers"]), int(model_cfg["hidden_size"]),
                                      int(option(model_cfg, "vocab_size")), int(model_cfg["seq_len"]),
                                      bool(option(model_cfg, "tie_embeddings")), bool(option(model_cfg, "pre_ln")))
    if name == "mlp":
        return mlp_parameters(int(model_cfg["num_layers"]), int(model_cfg["hidden_size"]))
    if name in VISION_MODELS:
        return vision_parameters(model_cfg)
    raise ValueError(f"model.name={name!r} has no parameter formula; known: {[*TRANSFORMERS, 'mlp', *VISION_MODELS]}")


def flops_per_iteration(model_cfg: Mapping[str, Any], batch: int, recompute: bool, seq_len: int | None = None) -> float:
    """Model FLOPs of one training iteration over ``batch`` samples (the numerator of MFU).

    GPT and BERT use eq. 4.2 (their GEMMs are the same; BERT's small MLM transform is left out, as
    the dissertation leaves out LayerNorms and biases); ``seq_len`` defaults to the model's context.
    A recomputed forward counts when the run recomputes, as in eq. 4.2's hardware-FLOPs accounting.
    """
    name = model_cfg["name"]
    if name == "mlp":
        return mlp_flops_per_iteration(batch, int(model_cfg["num_layers"]), int(model_cfg["hidden_size"]), recompute)
    if name in VISION_MODELS:   # forward, a backward of twice its FLOPs, the recomputed forward
        return (4 if recompute else 3) * batch * vision_forward_flops_per_sample(model_cfg)
    if name in TRANSFORMERS:
        return gpt_flops_per_iteration(batch, int(model_cfg["num_layers"]), int(model_cfg["hidden_size"]),
                                       int(option(model_cfg, "vocab_size")), int(seq_len or model_cfg["seq_len"]),
                                       recompute=recompute)
    raise ValueError(f"model.name={name!r} has no FLOP formula; known: {[*TRANSFORMERS, 'mlp', *VISION_MODELS]}")


def flops_per_sample(model_cfg: Mapping[str, Any], recompute: bool, seq_len: int | None = None) -> float:
    return flops_per_iteration(model_cfg, 1, recompute, seq_len)


def mlm_mask_id(vocab_size: int) -> int:
    """BERT's reserved [MASK] token: the last id (byte 255 never occurs in UTF-8 text)."""
    return vocab_size - 1
