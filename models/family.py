"""What the rest of the project may know about a built-in model family, declared once
(``models.registry`` lists the families). Code outside ``models`` asks a family's declared facts
(``data_kind``, ``sequence``, ``tensor_parallel``, ...) and never compares model names.

Torch-free: the builder and the tensor-parallel check name their functions as "module:function"
and are imported only when called, so the planner's dry run and the launcher read a family
without torch.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from models.spec import LayerModel
    from models.context_parallel import ContextParallel
    from models.expert_parallel import ExpertParallel
    from models.tensor_parallel import TensorParallel

# What the trainer feeds a family (``pipedream.data.datasets``)
TOKEN_WINDOWS = "token_windows"            # next-token prediction over windows of a token corpus
MASKED_LM = "masked_lm"                    # masked-language modelling over the same windows
TEACHER_REGRESSION = "teacher_regression"  # synthetic regression targets of a random teacher
IMAGES = "images"                          # labelled images (synthetic or a folder of classes)
DATA_KINDS = (TOKEN_WINDOWS, MASKED_LM, TEACHER_REGRESSION, IMAGES)

# Which of the planner's analytic spec builders describes a family (``planner.inputs.model_specs``)
TRANSFORMER_SPEC = "transformer"           # embedding, blocks, head with Megatron's tensor-parallel layout
BLOCK_CHAIN_SPEC = "block_chain"           # identical residual blocks, tp = 1
VISION_CHAIN_SPEC = "vision_chain"         # the layers of ``models.families.vision_facts``, tp = 1
LLAMA_SPEC = "llama"                       # as transformer, with grouped-query attention and a SwiGLU MLP
ANALYTIC_SPECS = (TRANSFORMER_SPEC, BLOCK_CHAIN_SPEC, VISION_CHAIN_SPEC, LLAMA_SPEC)


def transformer_layer_kinds(num_layers: int) -> tuple[str, ...]:
    return ("embedding", *["block"] * (num_layers - 2), "head")


def block_layer_kinds(num_layers: int) -> tuple[str, ...]:
    return ("block",) * num_layers


def plain_layer_kinds(num_layers: int) -> tuple[str, ...]:
    """Layers without a role (plugins too): each one recomputable."""
    return ("layer",) * num_layers


def no_further_checks(model_cfg: Mapping[str, Any], micro_batch: Any) -> None:
    """For families whose ``required_keys`` are all their configuration needs."""


def resolve(reference: str) -> Callable[..., Any]:
    """The function a "module:function" reference names (importing its module)."""
    module, _, function = reference.partition(":")
    return getattr(importlib.import_module(module), function)


@dataclass(frozen=True)
class ModelFamily:
    """One built-in family (``model.name``); a ``conf/model/*.yaml`` preset picks it and sets its keys.

    ``builder``: "module:function" called as ``(model_cfg, seed, tp)`` (tensor-parallel families)
    or ``(model_cfg, seed)``, returning the ``LayerModel``. ``required_keys``: keys that must be
    positive integers; ``check_config(model_cfg, micro_batch)`` the family's further rules (one
    ConfigError line each). ``layer_count`` / ``parameter_count`` / ``flops_per_iteration(model_cfg,
    batch, recompute, seq_len)`` are the facts of ``models.facts``; ``layer_kinds(n)`` labels the
    layers of a measured profile. ``tensor_parallel``: "module:function" checking
    ``(model_cfg, tp)``, None when the family has no tensor-parallel form. ``context_parallel``: its
    builder also takes a ``ContextParallel`` (``(model_cfg, seed, tp, cp)``). ``normalised_values(
    model_cfg, micro_batch)``: values per channel in the smallest BatchNorm of a forward, None when
    the family has no BatchNorm. ``sequence``: samples are token sequences (``seq_len`` applies).
    ``config_from_files(model_cfg)``: the model keys the family reads from the model's own files
    (``model=hf``: config.json), filled in when the config is composed
    (``pipedream.config.loading.complete_model_config``); None when the config states them all.
    ``hf_export``: "module:function" ``to_hf(model_state, model_cfg) -> (config_dict, hf_state)``
    turning a consolidated state (``<layer>.<name>``) into a Hugging Face checkpoint
    (``python -m pipedream.export format=hf``), None when the family has no such form.
    """

    name: str
    builder: str
    data_kind: str
    analytic_spec: str
    sequence: bool
    required_keys: tuple[str, ...]
    layer_count: Callable[[Mapping[str, Any]], int]
    parameter_count: Callable[[Mapping[str, Any]], int]
    flops_per_iteration: Callable[[Mapping[str, Any], int, bool, int | None], float]
    layer_kinds: Callable[[int], tuple[str, ...]] = plain_layer_kinds
    attention_core: bool = False   # its attention runs through models.attention.CoreAttention (selective recompute)
    sequence_parallel: bool = False   # its tensor-parallel form honours TensorParallel.sequence_parallel
    config_from_files: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    check_config: Callable[[Mapping[str, Any], Any], None] = no_further_checks
    tensor_parallel: str | None = None
    context_parallel: bool = False
    normalised_values: Callable[[Mapping[str, Any], int], int] | None = None
    hf_export: str | None = None

    def __post_init__(self) -> None:
        if self.data_kind not in DATA_KINDS:
            raise ValueError(f"model family {self.name}: data_kind {self.data_kind!r} is not one of {DATA_KINDS}")
        if self.analytic_spec not in ANALYTIC_SPECS:
            raise ValueError(f"model family {self.name}: analytic_spec {self.analytic_spec!r} is not one of "
                             f"{ANALYTIC_SPECS}")

    @property
    def batch_norm(self) -> bool:
        return self.normalised_values is not None

    def build(self, model_cfg: Any, seed: int = 0, tp: TensorParallel | None = None,
              cp: ContextParallel | None = None, ep: ExpertParallel | None = None) -> LayerModel:
        """Imports torch and the family's module. ``cp`` reaches only a context-parallel family
        (``models.build_model`` refuses it for the others), ``ep`` only an MoE model."""
        build = resolve(self.builder)
        if ep is not None:
            return build(model_cfg, seed, tp, cp, ep)
        if cp is not None:
            return build(model_cfg, seed, tp, cp)
        return build(model_cfg, seed, tp) if self.tensor_parallel else build(model_cfg, seed)

    def check_tensor_parallel(self, model_cfg: Any, tp: int) -> None:
        """Only for a family with a tensor-parallel form (``models.check_tensor_parallel_config``)."""
        resolve(str(self.tensor_parallel))(model_cfg, tp)
