"""The built-in model families, by ``model.name``: what each is built by, which data it trains on,
its facts and its configuration rules (``models.family.ModelFamily``). Adding a family is a module
that builds it, its torch-free facts, one entry here and a preset in ``conf/model/`` (docs/models.md,
"Adding a model family"). Plugins (``model._target_``) are not families.

Torch-free, like the facts it points to.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any

import models.families.llama_facts as llama_facts
import models.families.hf_facts as hf_facts
import models.families.mlp_facts as mlp_facts
import models.families.transformer_facts as transformer_facts
import models.families.vision_facts as vision_facts
from models.errors import ConfigError
from models.family import (BLOCK_CHAIN_SPEC, IMAGES, LLAMA_SPEC, MASKED_LM, TEACHER_REGRESSION, TOKEN_WINDOWS,
                           TRANSFORMER_SPEC, VISION_CHAIN_SPEC, ModelFamily, block_layer_kinds, plain_layer_kinds,
                           transformer_layer_kinds)

TRANSFORMER_FACTS = dict(analytic_spec=TRANSFORMER_SPEC, sequence=True, required_keys=transformer_facts.REQUIRED_KEYS,
                         layer_count=transformer_facts.transformer_layer_count,
                         flops_per_iteration=transformer_facts.transformer_flops_per_iteration,
                         check_config=transformer_facts.check_transformer_config, attention_core=True,
                         tensor_parallel="models.families.gpt:check_tensor_parallel_config")
VISION_FACTS = dict(data_kind=IMAGES, analytic_spec=VISION_CHAIN_SPEC, sequence=False,
                    required_keys=vision_facts.REQUIRED_KEYS, layer_count=vision_facts.vision_layer_count,
                    parameter_count=vision_facts.vision_parameters,
                    flops_per_iteration=vision_facts.vision_flops_per_iteration,
                    check_config=vision_facts.check_vision_config)

FAMILIES = (
    ModelFamily("gpt", builder="models.families.gpt:gpt_from_config", data_kind=TOKEN_WINDOWS,
                parameter_count=transformer_facts.gpt_parameter_count, layer_kinds=transformer_layer_kinds,
                sequence_parallel=True, context_parallel=True,
                hf_export="models.families.gpt_hf:gpt_to_hf", **TRANSFORMER_FACTS),
    # profiled as plain layers: a measured BERT profile has always labelled its layers so
    ModelFamily("bert", builder="models.families.bert:bert_from_config", data_kind=MASKED_LM,
                parameter_count=transformer_facts.bert_parameter_count, layer_kinds=plain_layer_kinds,
                **TRANSFORMER_FACTS),
    ModelFamily("mlp", builder="models.families.mlp:mlp_from_config", data_kind=TEACHER_REGRESSION,
                analytic_spec=BLOCK_CHAIN_SPEC, sequence=False, required_keys=mlp_facts.REQUIRED_KEYS,
                layer_count=mlp_facts.mlp_layer_count, parameter_count=mlp_facts.mlp_parameter_count,
                flops_per_iteration=mlp_facts.mlp_config_flops, layer_kinds=block_layer_kinds),
    ModelFamily("vgg16", builder="models.families.vision:vgg16_from_config", **VISION_FACTS),
    ModelFamily("resnet50", builder="models.families.vision:resnet50_from_config",
                normalised_values=vision_facts.fewest_normalised_values, **VISION_FACTS),
    ModelFamily("llama", builder="models.families.llama:llama_from_config", data_kind=TOKEN_WINDOWS,
                analytic_spec=LLAMA_SPEC, sequence=True, required_keys=llama_facts.REQUIRED_KEYS,
                layer_count=llama_facts.llama_layer_count, parameter_count=llama_facts.llama_parameter_count,
                flops_per_iteration=llama_facts.llama_flops_per_iteration, layer_kinds=transformer_layer_kinds,
                check_config=llama_facts.check_llama_config, attention_core=True, sequence_parallel=True,
                context_parallel=True,
                tensor_parallel="models.families.llama_facts:check_llama_tensor_parallel",
                hf_export="models.families.llama_hf:to_hf"),
    # a local transformers decoder folder (model.path); its sizes come from its config.json
    ModelFamily("hf", builder="models.families.hf:hf_from_config", data_kind=TOKEN_WINDOWS,
                analytic_spec=TRANSFORMER_SPEC, sequence=True, required_keys=(),
                layer_count=hf_facts.hf_layer_count, parameter_count=hf_facts.hf_parameter_count,
                flops_per_iteration=hf_facts.hf_flops_per_iteration, layer_kinds=transformer_layer_kinds,
                check_config=hf_facts.check_hf_config, config_from_files=hf_facts.config_from_files,
                context_parallel=True, hf_export="models.families.hf:to_hf"),
)
MODEL_FAMILIES = MappingProxyType({family.name: family for family in FAMILIES})


def model_family(name: Any) -> ModelFamily:
    """The family called ``name``; a one-line ConfigError naming the known ones otherwise."""
    family = known_family(name)
    if family is None:
        raise ConfigError(f"model.name={name!r} is not a model family; known: {', '.join(MODEL_FAMILIES)} "
                          f"(or give model._target_ for a plugin, docs/models.md)")
    return family


def known_family(name: Any) -> ModelFamily | None:
    """The family called ``name``, None for a plugin (no name) or an unknown name."""
    return MODEL_FAMILIES.get(name) if isinstance(name, str) else None
