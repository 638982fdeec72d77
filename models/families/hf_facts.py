"""A Hugging Face ``transformers`` decoder in a local folder (``model=hf model.path=DIR``), described
without torch: which layouts are supported, where each pipeline layer's tensors live in the
checkpoint, the config keys read from its ``config.json``, its parameter count (from the
safetensors headers) and FLOPs. ``models.families.hf`` builds what these describe.

Nothing here contacts the hub: ``model.path`` must be a folder as ``save_pretrained`` writes it.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from models.errors import ConfigError
from models.families.hf_moe_facts import hf_moe_config

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
INSTALL_HINT = "pip install .[hf]"
# The keys ``model=hf`` takes from config.json unless given on the command line (model.seq_len=N)
DERIVED_KEYS = ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size", "tie_embeddings")


@dataclass(frozen=True)
class HFLayout:
    """Where a supported architecture keeps embeddings -> N decoder layers -> final norm -> LM head.

    Names are module paths in the ``*ForCausalLM``; ``positions`` is a learned position table
    (GPT-2), None for rotary models; ``rotary`` is the module computing RoPE's cos and sin."""

    architecture: str
    embed: str
    layers: str
    norm: str
    head: str = "lm_head"
    positions: str | None = None
    rotary: str | None = None
    dropout: str | None = None      # the embedding's dropout (GPT-2's embd_pdrop)
    attention: str = "self_attn"    # the attention module inside a decoder layer


LLAMA_LAYOUT = dict(embed="model.embed_tokens", layers="model.layers", norm="model.norm", rotary="model.rotary_emb")
LAYOUTS = MappingProxyType({
    "llama": HFLayout("LlamaForCausalLM", **LLAMA_LAYOUT),
    "mistral": HFLayout("MistralForCausalLM", **LLAMA_LAYOUT),
    "qwen2": HFLayout("Qwen2ForCausalLM", **LLAMA_LAYOUT),
    # mixture-of-experts decoders: their MoE blocks are models.families.moe's (models.families.hf_moe)
    "mixtral": HFLayout("MixtralForCausalLM", **LLAMA_LAYOUT),
    "qwen2_moe": HFLayout("Qwen2MoeForCausalLM", **LLAMA_LAYOUT),
    "gpt2": HFLayout("GPT2LMHeadModel", embed="transformer.wte", layers="transformer.h", norm="transformer.ln_f",
                     positions="transformer.wpe", dropout="transformer.drop", attention="attn"),
})
# config.json's names for the sizes, per model_type (GPT-2 keeps its original names)
SIZE_NAMES = MappingProxyType({
    "gpt2": dict(num_layers="n_layer", hidden_size="n_embd", num_heads="n_head", seq_len="n_positions"),
})
STANDARD_SIZE_NAMES = dict(num_layers="num_hidden_layers", hidden_size="hidden_size", num_heads="num_attention_heads",
                           seq_len="max_position_embeddings")


def supported_architectures() -> str:
    return ", ".join(layout.architecture for layout in LAYOUTS.values())


def model_folder(model_cfg: Mapping[str, Any]) -> Path:
    """``model.path`` as a folder holding config.json; one ConfigError line otherwise."""
    try:
        path = model_cfg.get("path")
    except Exception:  # noqa: BLE001 - OmegaConf's mandatory value (???) left unset
        path = None
    if path in (None, "", "???"):
        raise ConfigError("model=hf needs model.path=DIR: a local transformers model folder (config.json and "
                          "*.safetensors, as save_pretrained writes them)")
    folder = Path(str(path)).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"model.path={str(path)!r} does not exist or is not a folder: give a local transformers "
                          f"model folder (the hub is never contacted)")
    if not (folder / CONFIG_FILE).is_file():
        raise ConfigError(f"model.path={str(path)!r} has no {CONFIG_FILE}: give the folder save_pretrained wrote")
    return folder


def read_hf_config(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The model folder's config.json as a dict."""
    return json.loads((model_folder(model_cfg) / CONFIG_FILE).read_text())


def layout_of(hf_config: Mapping[str, Any], where: str = "") -> HFLayout:
    """The layout of a supported decoder; one ConfigError line naming what was found otherwise."""
    model_type = hf_config.get("model_type")
    layout = LAYOUTS.get(model_type) if isinstance(model_type, str) else None
    architectures = list(hf_config.get("architectures") or [])
    if layout is None or (architectures and architectures[0] != layout.architecture):
        found = architectures[0] if architectures else f"model_type={model_type!r}"
        raise ConfigError(f"{where}config.json describes {found}, which model=hf cannot split into pipeline layers: "
                          f"supported are {supported_architectures()} (decoder-only: embeddings, decoder layers, "
                          f"final norm, LM head)")
    return layout


def config_from_files(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The model keys config.json decides (``DERIVED_KEYS``); the family's ``config_from_files``."""
    hf_config = read_hf_config(model_cfg)
    layout_of(hf_config, f"model.path={model_cfg.get('path')}: ")
    names = SIZE_NAMES.get(hf_config["model_type"], STANDARD_SIZE_NAMES)
    values = {key: hf_config.get(name) for key, name in names.items()}
    values["vocab_size"] = hf_config.get("vocab_size")
    values["tie_embeddings"] = bool(hf_config.get("tie_word_embeddings", True))
    missing = [names.get(key, key) for key, value in values.items() if value is None]
    if missing:
        raise ConfigError(f"model.path={model_cfg.get('path')}: config.json lacks {', '.join(missing)}: give the "
                          f"config save_pretrained wrote")
    return values


def check_hf_config(model_cfg: Mapping[str, Any], micro_batch: Any) -> None:
    """The family's configuration rules: the folder, its architecture and its weights."""
    hf_config = read_hf_config(model_cfg)
    layout_of(hf_config, f"model.path={model_cfg.get('path')}: ")
    weight_files(model_folder(model_cfg))
    try:   # what an MoE decoder's model=hf cannot reproduce
        hf_moe_config(hf_config)
    except ConfigError as problem:
        raise ConfigError(f"model.path={model_cfg.get('path')}: {problem}") from None
    context = int(hf_config.get(SIZE_NAMES.get(hf_config["model_type"], STANDARD_SIZE_NAMES)["seq_len"]))
    seq_len = model_cfg.get("seq_len")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or not 0 < seq_len <= context:
        raise ConfigError(f"model.seq_len={seq_len!r} must be a positive integer at most the model's context "
                          f"({context}, config.json): lower it or leave it out")
    stated = config_from_files(model_cfg)
    for key in ("vocab_size", "num_layers", "hidden_size", "num_heads"):
        if model_cfg.get(key) != stated[key]:
            raise ConfigError(f"model.{key}={model_cfg.get(key)!r} differs from the model's config.json "
                              f"({stated[key]}): leave model.{key} out for model=hf")


def weight_files(folder: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it (a sharded index or one file)."""
    index = folder / INDEX_FILE
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = folder / SINGLE_FILE
    if single.is_file():
        return {name: SINGLE_FILE for name in safetensors_header(single)}
    raise ConfigError(f"model.path={str(folder)!r} has neither {INDEX_FILE} nor {SINGLE_FILE}: save the model with "
                      f"save_pretrained (safetensors)")


def safetensors_header(path: Path) -> dict[str, Any]:
    """Tensor name -> {dtype, shape, data_offsets}, read from the file's JSON header alone."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header


def tensor_shapes(model_cfg: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every stored tensor's shape, from the headers (no tensor is read)."""
    folder = model_folder(model_cfg)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(weight_files(folder).values())):
        shapes.update({name: tuple(entry["shape"]) for name, entry in safetensors_header(folder / file).items()})
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def hf_layer_count(model_cfg: Mapping[str, Any]) -> int:
    """[embedding, decoder layers, head]."""
    return int(config_from_files(model_cfg)["num_layers"]) + 2


def hf_parameter_count(model_cfg: Mapping[str, Any]) -> int:
    """Parameters the checkpoint stores (a tied head is stored once, as save_pretrained does)."""
    return sum(_numel(shape) for shape in tensor_shapes(model_cfg).values())


def hf_flops_per_iteration(model_cfg: Mapping[str, Any], batch: int, recompute: bool,
                           seq_len: int | None = None) -> float:
    """2 FLOPs per multiply-add of every GEMM weight (the decoder layers' matrices and the LM head, not
    the embedding lookups) per token, plus attention's two s x s products (4 s^2 h per layer and
    sequence); backward twice the forward, and a recomputed forward when the run recomputes. A token
    goes through top_k of a mixture-of-experts layer's routed experts: they count top_k / num_experts."""
    sizes = config_from_files(model_cfg)
    hf_config = read_hf_config(model_cfg)
    layout = layout_of(hf_config)
    shapes = tensor_shapes(model_cfg)
    h, vocab, layers = int(sizes["hidden_size"]), int(sizes["vocab_size"]), int(sizes["num_layers"])
    moe = hf_moe_config(hf_config)
    routed_share = 1.0 if moe is None else moe.top_k / moe.num_experts
    gemm = sum(_numel(shape) * (routed_share if ".experts." in name else 1.0) for name, shape in shapes.items()
               if name.startswith(layout.layers + ".") and len(shape) == 2) + vocab * h
    s = int(seq_len or model_cfg.get("seq_len") or sizes["seq_len"])
    forward = 2 * s * gemm + 4 * layers * s * s * h
    return float(batch * forward * (4 if recompute else 3))


def hf_stage_keys(layout: HFLayout, num_layers: int, index: int, stored: Mapping[str, str],
                  tie: bool) -> dict[str, str]:
    """Pipeline layer ``index``'s tensors: its local name -> the checkpoint's name. Layer 0 is the
    embedding, 1..N the decoder layers, N + 1 the final norm and head (a tied head reads the
    embedding's table when the checkpoint omits ``lm_head.weight``)."""
    def under(prefix: str, local: str) -> dict[str, str]:
        return {f"{local}.{name[len(prefix) + 1:]}": name for name in stored if name.startswith(prefix + ".")}

    if index == 0:
        keys = under(layout.embed, "embed")
        if layout.positions:
            keys.update(under(layout.positions, "positions"))
        return keys
    if index <= num_layers:
        return under(f"{layout.layers}.{index - 1}", "layer")
    keys = under(layout.norm, "norm")
    head = f"{layout.head}.weight"
    keys["lm_head.weight"] = f"{layout.embed}.weight" if tie and head not in stored else head
    return keys
