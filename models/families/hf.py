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

from models.context_parallel import ContextParallel
from models.expert_parallel import ExpertParallel
from models.group_context import splitting
from models.errors import ConfigError
from models.families.gpt import language_model_loss
from models.families.hf_facts import (INSTALL_HINT, HFLayout, config_from_files, hf_stage_keys, layout_of,
                                      model_folder, read_hf_config, weight_files)
from models.families.hf_context_parallel import check_hf_context_parallel, use_ring_attention
from models.families.hf_layers import HFDecoderLayer, HFEmbedding, HFHead, sliding_layer
from models.families.hf_moe import (HFMoEDecoderLayer, HFMoEEmbedding, HFMoEHead, WholeModelMoEStatistics,
                                    mark_experts, read_fused, routed_mlp)
from models.families.hf_moe_facts import hf_moe_config, is_moe_layer, moe_layer_count, moe_layer_keys
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


def hf_model(model_cfg: Any, seed: int = 0, checkpoint: SafetensorsCheckpoint | None = None,
             cp: ContextParallel | None = None, ep: ExpertParallel | None = None) -> LayerModel:
    """The model folder ``model_cfg["path"]`` as a ``LayerModel``. ``checkpoint`` reads the tensors
    (one per model by default; pass one to see what was read). ``seed`` is unused: the weights are
    the checkpoint's. With ``cp`` (size > 1) the layers take this rank's zigzag shard of each
    sequence (``split_zigzag``) and the loss is the local mean, as the gpt and llama families'.
    A mixture-of-experts decoder's MoE blocks are ``models.families.moe``'s (``hf_moe``); with
    ``ep`` (size > 1) each holds, and reads, only this rank's experts."""
    transformers = require_transformers()
    folder = model_folder(model_cfg)
    hf_config = read_hf_config(model_cfg)
    where = f"model.path={model_cfg.get('path')}: "
    layout = layout_of(hf_config, where)
    sizes = config_from_files(model_cfg)
    num_blocks, vocab_size = int(sizes["num_layers"]), int(sizes["vocab_size"])
    seq_len = int(model_cfg.get("seq_len") or sizes["seq_len"])
    tie = bool(sizes["tie_embeddings"])
    config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    cp = splitting(cp)
    moe = hf_moe_config(hf_config)
    if cp is not None:
        if moe is not None:
            raise ConfigError(f"{where}parallel.cp={cp.size} with a mixture-of-experts model: its load-balancing "
                              f"loss is over every token of a sequence; set parallel.cp=1")
        check_hf_context_parallel(config, num_blocks, seq_len, cp, where, sliding_layer)
    ep = splitting(ep)
    reader = checkpoint or SafetensorsCheckpoint(folder)
    last = num_blocks + 1
    statistics = None if moe is None else WholeModelMoEStatistics(moe.num_experts)
    moe_layers = 0 if moe is None else moe_layer_count(hf_config, moe, num_blocks)

    @cache
    def skeleton() -> nn.Module:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    def materialise(module: nn.Module) -> nn.Module:
        device = torch.get_default_device()
        return module if device.type == "meta" else module.to_empty(device=device)

    def part(name: str | None) -> nn.Module | None:
        return None if name is None else materialise(copy.deepcopy(skeleton().get_submodule(name)))

    def decoder_layer(block: int) -> nn.Module:
        if moe is None or not is_moe_layer(hf_config, moe, block):
            return part(f"{layout.layers}.{block}")
        layer = copy.deepcopy(skeleton().get_submodule(f"{layout.layers}.{block}"))
        layer.mlp = routed_mlp(config, moe, statistics, moe_layers, ep)
        materialise(layer)
        mark_experts(layer.mlp, ep)
        return layer

    def build_layer(i: int) -> nn.Module:
        if i == 0:
            parts = (part(layout.embed), part(layout.positions), part(layout.dropout), cp)
            layer = HFEmbedding(*parts) if moe is None else HFMoEEmbedding(*parts, num_experts=moe.num_experts)
        elif i == last:
            layer = (HFHead(part(layout.norm), part(layout.head)) if moe is None else
                     HFMoEHead(part(layout.norm), part(layout.head), moe, moe_layers, statistics))
        else:
            rotary = type(skeleton().get_submodule(layout.rotary))(config=config) if layout.rotary else None
            wrapper = HFDecoderLayer if moe is None else HFMoEDecoderLayer
            layer = wrapper(decoder_layer(i - 1), config, rotary, sliding_layer(config, i - 1), cp)
            if cp is not None:
                use_ring_attention(layer.layer.get_submodule(layout.attention), cp)
        if torch.get_default_device().type != "meta":
            load_layer(layer, layout, i)
        return layer

    def load_layer(layer: nn.Module, layout: HFLayout, i: int) -> None:
        if moe is not None and 0 < i < last and is_moe_layer(hf_config, moe, i - 1):
            experts = range(moe.num_experts) if ep is None else ep.local_experts(moe.num_experts)
            keys = moe_layer_keys(hf_config, moe, f"{layout.layers}.{i - 1}", reader.files, experts)
            tensors = reader.read(sorted({name for names in keys.values() for name in names}))
            layer.load_state_dict(read_fused(tensors, keys), strict=True)
            return
        keys = hf_stage_keys(layout, num_blocks, i, reader.files, tie)
        tensors = reader.read(sorted(set(keys.values())))
        layer.load_state_dict({local: tensors[stored] for local, stored in keys.items()}, strict=True)

    def make_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(vocab_size, (batch_size, seq_len + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    tied = (((0, "embed.weight"), (last, "lm_head.weight")),) if tie else ()
    return LayerModel(name="hf", num_layers=num_blocks + 2, build_layer=build_layer, loss_fn=language_model_loss,
                      make_batch=make_batch, tied=tied, statistics=statistics)


def hf_from_config(model_cfg: Any, seed: int = 0, tp: Any = None, cp: ContextParallel | None = None,
                   ep: ExpertParallel | None = None) -> LayerModel:
    """``model=hf`` (``models.registry``); ``tp`` is always None (the family has no tensor-parallel form)."""
    return hf_model(model_cfg, seed, cp=cp, ep=ep)


def to_hf(model_state: dict[str, torch.Tensor], model_cfg: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A trained ``model=hf`` state (``<layer>.<name>``) back under the checkpoint's own names, with the
    original config.json (its dtype set to the stored tensors'); a tied head is stored once."""
    hf_config = read_hf_config(model_cfg)
    layout = layout_of(hf_config)
    sizes = config_from_files(model_cfg)
    num_blocks, tie = int(sizes["num_layers"]), bool(sizes["tie_embeddings"])
    stored = weight_files(model_folder(model_cfg))
    moe = hf_moe_config(hf_config)
    state: dict[str, torch.Tensor] = {}
    for i in range(num_blocks + 2):
        if moe is not None and 0 < i <= num_blocks and is_moe_layer(hf_config, moe, i - 1):
            keys = moe_layer_keys(hf_config, moe, f"{layout.layers}.{i - 1}", stored, range(moe.num_experts))
            for local, names in keys.items():   # a fused [gate; up] goes back as its two halves
                state.update(zip(names, model_state[f"{i}.{local}"].chunk(len(names), dim=0)))
            continue
        for local, name in hf_stage_keys(layout, num_blocks, i, stored, tie).items():
            if tie and local == "lm_head.weight":
                continue
            state[name] = model_state[f"{i}.{local}"]
    hf_config = {key: value for key, value in hf_config.items() if key != "torch_dtype"}
    dtypes = {str(tensor.dtype).removeprefix("torch.") for tensor in state.values()}
    hf_config["dtype"] = dtypes.pop() if len(dtypes) == 1 else "float32"
    return hf_config, state
