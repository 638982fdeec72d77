"""GPT and BERT described without torch: optional keys, pipeline layers, parameters, FLOPs, the
reserved [MASK] id and the configuration rules. ``models.families.gpt`` / ``models.families.bert`` build what these
describe; ``models.registry`` declares both families with them.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

from models.errors import ConfigError
from models.families.formulas import gpt_flops_per_iteration, gpt_parameters

EMBEDDING_AND_HEAD = 2  # a transformer's pipeline layers beyond its blocks
REQUIRED_KEYS = ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size")
# The keys a transformer's config may leave out, and what leaving one out means (the presets in
# conf/model/ state them; hand-written mappings, e.g. in tests, may not). Read through ``option``.
OPTIONAL_KEYS = MappingProxyType({"vocab_size": 256, "tie_embeddings": True, "dropout": 0.0, "pre_ln": False,
                                  "mask_fraction": 0.15})


def option(model_cfg: Mapping[str, Any], key: str) -> Any:
    """``model_cfg[key]``, or its meaning when left out (``OPTIONAL_KEYS``)."""
    return model_cfg.get(key, OPTIONAL_KEYS[key])


def transformer_pipeline_layers(num_blocks: int) -> int:
    """[embedding, block_0 .. block_{L-1}, head]: the layer list ``models.families.gpt`` / ``models.families.bert`` build."""
    return num_blocks + EMBEDDING_AND_HEAD


def transformer_layer_count(model_cfg: Mapping[str, Any]) -> int:
    return transformer_pipeline_layers(int(model_cfg["num_layers"]))


def _blocks_and_embeddings(model_cfg: Mapping[str, Any]) -> int:
    """Eq. 4.3 (``gpt_parameters``): blocks, token and position embeddings; an untied head adds
    its own V x h matrix."""
    h, vocab = int(model_cfg["hidden_size"]), int(option(model_cfg, "vocab_size"))
    shared = gpt_parameters(int(model_cfg["num_layers"]), h, vocab, int(model_cfg["seq_len"]))
    return shared + (0 if bool(option(model_cfg, "tie_embeddings")) else vocab * h)


def gpt_parameter_count(model_cfg: Mapping[str, Any]) -> int:
    """Parameters of the dense ``models.families.gpt`` model (a tied tensor counted once): eq. 4.3 plus the
    final LayerNorm."""
    return _blocks_and_embeddings(model_cfg) + 2 * int(model_cfg["hidden_size"])


def bert_parameter_count(model_cfg: Mapping[str, Any]) -> int:
    """Parameters of the dense ``models.families.bert`` model: eq. 4.3 plus the embedding LayerNorm and the
    MLM head (dense h x h, LayerNorm, vocabulary bias, and a final LayerNorm when pre-LN)."""
    h, vocab = int(model_cfg["hidden_size"]), int(option(model_cfg, "vocab_size"))
    head = (h * h + h) + 2 * h + vocab + (2 * h if bool(option(model_cfg, "pre_ln")) else 0)
    return _blocks_and_embeddings(model_cfg) + 2 * h + head


def transformer_flops_per_iteration(model_cfg: Mapping[str, Any], batch: int, recompute: bool,
                                    seq_len: int | None = None) -> float:
    """Eq. 4.2 for GPT and BERT (their GEMMs are the same; BERT's small MLM transform is left out,
    as the dissertation leaves out LayerNorms and biases); ``seq_len`` defaults to the context."""
    return gpt_flops_per_iteration(batch, int(model_cfg["num_layers"]), int(model_cfg["hidden_size"]),
                                   int(option(model_cfg, "vocab_size")), int(seq_len or model_cfg["seq_len"]),
                                   recompute=recompute)


def check_transformer_config(model_cfg: Mapping[str, Any], micro_batch: Any) -> None:
    """Attention splits the hidden size into ``num_heads`` equal heads."""
    hidden, heads = model_cfg["hidden_size"], model_cfg["num_heads"]
    if hidden % heads:
        raise ConfigError(f"model.num_heads={heads} does not divide model.hidden_size={hidden}: "
                          f"choose heads among the divisors of {hidden}")


def mlm_mask_id(vocab_size: int) -> int:
    """BERT's reserved [MASK] token: the last id (byte 255 never occurs in UTF-8 text)."""
    return vocab_size - 1
