"""Your own Hugging Face ``transformers`` decoder (``model=hf model.path=DIR``) as pipeline layers:
[embedding (+ learned positions), decoder layer 0 .. N-1, head (final norm + LM head)].

Each layer is cut out of a skeleton of the whole ``*ForCausalLM`` built on the meta device (no
memory), then materialised alone and filled with its own tensors only, read with
``safetensors.safe_open`` from the folder's (possibly sharded) files. A pipeline stage builds only
the layers it owns (``LayerModel.build(indices)``), so no process ever holds the whole model.
Rotary position embeddings and the causal mask are computed inside every decoder-layer wrapper,
so stages need nothing but the hidden states from each other. Under ``torch.device("meta")`` (the
runtime's shape inference) layers are built without reading any tensor. With a context-parallel
group the layers take a rank's zigzag shard of each sequence (``hf_context_parallel``).
"""
from __future__ import annotations

import copy
from collections import defaultdict
from functools import cache
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from models.context_parallel import ContextParallel, global_positions
from models.group_context import splitting
from models.errors import ConfigError
from models.families.gpt import language_model_loss
from models.families.hf_facts import (INSTALL_HINT, HFLayout, config_from_files, hf_stage_keys, layout_of,
                                      model_folder, read_hf_config, weight_files)
from models.families.hf_context_parallel import check_hf_context_parallel, use_ring_attention
from models.spec import LayerModel


def require_transformers() -> Any:
    """``transformers``, or one line saying how to install it."""
    try:
        import safetensors  # noqa: F401 - the loader needs it too
        import transformers
    except ImportError as missing:
        raise ConfigError(f"model=hf needs the Hugging Face packages ({missing.name} is missing): "
                          f"{INSTALL_HINT}") from None
    return transformers


class SafetensorsCheckpoint:
    """Reads named tensors from a model folder, opening only the files that hold them.
    ``keys_read`` lists every tensor read so far (what a stage loaded, for the record)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.files = weight_files(folder)
        self.keys_read: list[str] = []

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open
        by_file: dict[str, list[str]] = defaultdict(list)
        for name in names:
            by_file[self.files[name]].append(name)
        tensors = {}
        for file, group in by_file.items():
            with safe_open(str(self.folder / file), framework="pt") as handle:
                for name in group:
                    tensors[name] = handle.get_tensor(name)
                    self.keys_read.append(name)
        return tensors


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


def hf_model(model_cfg: Any, seed: int = 0, checkpoint: SafetensorsCheckpoint | None = None,
             cp: ContextParallel | None = None) -> LayerModel:
    """The model folder ``model_cfg["path"]`` as a ``LayerModel``. ``checkpoint`` reads the tensors
    (one per model by default; pass one to see what was read). ``seed`` is unused: the weights are
    the checkpoint's. With ``cp`` (size > 1) the layers take this rank's zigzag shard of each
    sequence (``split_zigzag``) and the loss is the local mean, as the gpt and llama families'."""
    transformers = require_transformers()
    folder = model_folder(model_cfg)
    layout = layout_of(read_hf_config(model_cfg), f"model.path={model_cfg.get('path')}: ")
    sizes = config_from_files(model_cfg)
    num_blocks, vocab_size = int(sizes["num_layers"]), int(sizes["vocab_size"])
    seq_len = int(model_cfg.get("seq_len") or sizes["seq_len"])
    tie = bool(sizes["tie_embeddings"])
    config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    cp = splitting(cp)
    if cp is not None:
        check_hf_context_parallel(config, num_blocks, seq_len, cp, f"model.path={model_cfg.get('path')}: ",
                                  sliding_layer)
    reader = checkpoint or SafetensorsCheckpoint(folder)
    last = num_blocks + 1

    @cache
    def skeleton() -> nn.Module:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    def part(name: str | None) -> nn.Module | None:
        if name is None:
            return None
        module = copy.deepcopy(skeleton().get_submodule(name))
        device = torch.get_default_device()
        return module if device.type == "meta" else module.to_empty(device=device)

    def build_layer(i: int) -> nn.Module:
        if i == 0:
            layer = HFEmbedding(part(layout.embed), part(layout.positions), part(layout.dropout), cp)
        elif i == last:
            layer = HFHead(part(layout.norm), part(layout.head))
        else:
            rotary = type(skeleton().get_submodule(layout.rotary))(config=config) if layout.rotary else None
            layer = HFDecoderLayer(part(f"{layout.layers}.{i - 1}"), config, rotary, sliding_layer(config, i - 1), cp)
            if cp is not None:
                use_ring_attention(layer.layer.get_submodule(layout.attention), cp)
        if torch.get_default_device().type != "meta":
            load_layer(layer, layout, i)
        return layer

    def load_layer(layer: nn.Module, layout: HFLayout, i: int) -> None:
        keys = hf_stage_keys(layout, num_blocks, i, reader.files, tie)
        tensors = reader.read(sorted(set(keys.values())))
        layer.load_state_dict({local: tensors[stored] for local, stored in keys.items()}, strict=True)

    def make_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(vocab_size, (batch_size, seq_len + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    tied = (((0, "embed.weight"), (last, "lm_head.weight")),) if tie else ()
    return LayerModel(name="hf", num_layers=num_blocks + 2, build_layer=build_layer, loss_fn=language_model_loss,
                      make_batch=make_batch, tied=tied)


def hf_from_config(model_cfg: Any, seed: int = 0, tp: Any = None, cp: ContextParallel | None = None) -> LayerModel:
    """``model=hf`` (``models.registry``); ``tp`` is always None (the family has no tensor-parallel form)."""
    return hf_model(model_cfg, seed, cp=cp)


def to_hf(model_state: dict[str, torch.Tensor], model_cfg: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A trained ``model=hf`` state (``<layer>.<name>``) back under the checkpoint's own names, with the
    original config.json (its dtype set to the stored tensors'); a tied head is stored once."""
    hf_config = read_hf_config(model_cfg)
    layout = layout_of(hf_config)
    sizes = config_from_files(model_cfg)
    num_blocks, tie = int(sizes["num_layers"]), bool(sizes["tie_embeddings"])
    stored = weight_files(model_folder(model_cfg))
    state: dict[str, torch.Tensor] = {}
    for i in range(num_blocks + 2):
        for local, name in hf_stage_keys(layout, num_blocks, i, stored, tie).items():
            if tie and local == "lm_head.weight":
                continue
            state[name] = model_state[f"{i}.{local}"]
    hf_config = {key: value for key, value in hf_config.items() if key != "torch_dtype"}
    dtypes = {str(tensor.dtype).removeprefix("torch.") for tensor in state.values()}
    hf_config["dtype"] = dtypes.pop() if len(dtypes) == 1 else "float32"
    return hf_config, state
