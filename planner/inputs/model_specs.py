"""Analytic model descriptions: per-layer FLOPs, parameters and activation sizes, for models far too
large to build (the GPT family of Table 4.1, GPT-3, BERT-Large, Llama 3) and the CNNs PipeDream evaluated.

A model is an ordered list of partitionable layers (the same granularity as ``models.LayerModel``:
embedding, one entry per transformer block, head). ``layer_specs(tp)`` gives the per-device costs
at tensor-parallel degree ``tp``, per sample (one sequence or one image). Whole-model totals of the
trainable families (parameters, FLOPs per sample) come from ``models.facts``, as the runtime's do.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from models.facts import flops_per_sample, parameter_count
from models.errors import ConfigError
from models.family import BLOCK_CHAIN_SPEC, LLAMA_SPEC, TRANSFORMER_SPEC, VISION_CHAIN_SPEC
from models.families.formulas import mlp_block_forward_flops
from models.families.llama_facts import kv_heads_per_rank, llama_active_parameter_count, llama_option
from models.families.moe_facts import MoEConfig, moe_config, moe_mlp_active_parameters, moe_mlp_parameters, \
    swiglu_parameters
from models.families.mlp_facts import mlp_parameters
from models.registry import MODEL_FAMILIES, known_family
from models.families.transformer_facts import option
from models.families.vision_facts import VisionLayer, vision_layers

from planner.errors import PlannerError

PRECISION_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


@dataclass(frozen=True)
class ParameterBytes:
    """Bytes per parameter at a precision, as the planner's memory model counts them: Megatron's
    mixed-precision scheme (ZeRO's accounting, Rajbhandari et al. 2020), which the paper presets
    were calibrated with. The runtime's scheme (autocast over fp32 parameters) holds 18 in total
    and keeps weight versions in fp32 (docs/design.md, Mixed precision)."""

    weights: float        # per weight version, in the compute dtype
    gradients: float      # as large as the weights
    master: float         # fp32 master copy (mixed precision only)
    optimizer: float      # Adam's m and v, fp32

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.master + self.optimizer


def parameter_bytes(precision: str) -> ParameterBytes:
    """fp32: 4 + 4 + 0 + 8; bf16/fp16: 2 + 2 + 4 + 8; 16 bytes per parameter either way."""
    e = float(PRECISION_BYTES[precision])
    return ParameterBytes(weights=e, gradients=e, master=4.0 if e < 4 else 0.0, optimizer=8.0)


@dataclass(frozen=True)
class LayerSpec:
    """Per device and per sample. ``gemm_flops`` sizes the layer's typical GEMM (for efficiency)."""

    name: str
    kind: str  # embedding | block | head | layer
    forward_flops: float
    gemm_flops: float
    memory_traffic_bytes: float
    parameters: float
    output_bytes: float
    activation_bytes: float
    activation_bytes_recompute: float
    tp_forward_bytes: float = 0.0  # bytes each device sends in tensor-parallel all-reduces, forward
    tp_backward_bytes: float = 0.0
    recomputable: bool = True
    # Of activation_bytes: the part sequence parallelism shards t ways (LayerNorm, dropout, residual
    # regions), and the attention core's (scores, softmax, dropout mask) that selective
    # recomputation drops, whose forward FLOPs it then spends again in the backward.
    sequence_shardable_bytes: float = 0.0
    attention_core_bytes: float = 0.0
    attention_core_flops: float = 0.0
    # K and V of this rank's key/value heads over the whole sequence: what context parallelism's ring
    # passes on, a 1/c share per ring step (0: the layer has no attention to split by sequence)
    ring_bytes: float = 0.0
    # MoE blocks: the routed experts' parameters (of ``parameters``; what expert parallelism splits),
    # and the bytes one all-to-all (dispatch, or combine) moves for a sample, before the (ep-1)/ep share
    expert_parameters: float = 0.0
    alltoall_bytes: float = 0.0


@dataclass(frozen=True)
class TransformerSpec:
    """GPT (decoder, causal) or BERT (encoder) with Megatron's tensor-parallel layout (ch. 4.2.3)."""

    name: str
    family: str  # gpt | bert
    num_layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    precision: str = "bf16"
    tie_embeddings: bool = True
    pre_ln: bool = False  # BERT only: pre-LayerNorm blocks add a final LayerNorm
    path: str | None = None   # a model read from its own files (model=hf): its totals come from them
    # True: the attention core is one fused kernel (F.scaled_dot_product_attention, as the runtime and
    # every current trainer run it) that keeps only a row statistic for the backward; False: the
    # anchor paper's accounting (Korthikanti et al. 2022), the scores, softmax and dropout mask stored
    fused_attention: bool = True

    @property
    def max_tp(self) -> int:
        return self.heads

    def allows_tp(self, tp: int) -> bool:
        """Whole heads per rank (the hidden size and the 4h MLP then split too)."""
        return self.heads % tp == 0

    @property
    def model_cfg(self) -> dict[str, Any]:
        """The ``conf/model`` keys this spec stands for, as ``models.facts`` reads them."""
        return {"name": self.family, "num_layers": self.num_layers, "hidden_size": self.hidden,
                "num_heads": self.heads, "seq_len": self.seq_len, "vocab_size": self.vocab,
                "tie_embeddings": self.tie_embeddings, "pre_ln": self.pre_ln,
                **({"path": self.path} if self.path is not None else {})}

    def num_parameters(self) -> int:
        """Of the model ``models`` builds for this config (eq. 4.3 plus LayerNorms and BERT's MLM head)."""
        return parameter_count(self.model_cfg)

    def flops_per_sample(self, recompute: bool) -> float:
        """Eq. 4.2 for one sequence (its recompute term follows the plan's choice)."""
        return flops_per_sample(self.model_cfg, recompute)

    def layer_specs(self, tp: int = 1) -> list[LayerSpec]:
        s, h, a, v, t = self.seq_len, self.hidden, self.heads, self.vocab, tp
        e = PRECISION_BYTES[self.precision]
        ar = 2 * (t - 1) / t  # ring all-reduce: bytes sent per byte reduced (Patarasuk & Yuan 2009)
        # Korthikanti et al. 2022, eq. 2 (no sequence parallelism): s h (10 + 24/t + 5 a s/(h t)) bytes in fp16;
        # of it, s h 10 is replicated over t (sharded by sequence parallelism) and 5 a s^2 / t is the attention
        # core. A fused kernel keeps its fp32 log-sum-exp (4 a s / t bytes) instead of those s x s tensors.
        core_act = (4 * a * s / t if self.fused_attention else 5 * a * s * s / t * e / 2)
        block_act = s * h * (10 + 24 / t) * e / 2 + core_act
        replicated_act = s * h * 10 * e / 2
        block = LayerSpec(
            name="block", kind="block",
            forward_flops=(24 * s * h * h + 4 * s * s * h) / t,  # ch. 4.5.1: 24Bsh^2 + 4Bs^2h per layer
            gemm_flops=2 * s * h * h / t,
            memory_traffic_bytes=block_act,
            parameters=(12 * h * h + 13 * h) / t,  # eq. 4.3's per-layer term, split t ways
            output_bytes=s * h * e,
            activation_bytes=block_act,
            activation_bytes_recompute=s * h * e,  # checkpoint each layer's input (ch. 4.3.5, c = l)
            tp_forward_bytes=2 * ar * s * h * e,  # ch. 4.3.2: 2 all-reduces of bsh forward ...
            tp_backward_bytes=2 * ar * s * h * e,  # ... and 2 backward: 8bsh(t-1)/t per layer
            sequence_shardable_bytes=replicated_act, attention_core_bytes=core_act,
            attention_core_flops=4 * s * s * h / t,  # QK^T and softmax . V: the 4Bs^2h of ch. 4.5.1
            ring_bytes=2 * s * (h // t) * e,
        )
        embedding = LayerSpec(
            name="embedding", kind="embedding", forward_flops=0.0, gemm_flops=0.0,
            memory_traffic_bytes=3 * s * h * e, parameters=v * h / t + s * h,
            output_bytes=s * h * e, activation_bytes=s * h, activation_bytes_recompute=s * h,
            tp_forward_bytes=ar * s * h * e, recomputable=False)  # vocab-parallel lookup: one all-reduce
        head = LayerSpec(
            name="head", kind="head",
            forward_flops=2 * s * h * v / t,  # ch. 4.5.1: the logit layer, 2BshV forward
            gemm_flops=2 * s * h * v / t,
            memory_traffic_bytes=s * v / t * (e + 4), parameters=v * h / t + 2 * h,
            output_bytes=4.0, activation_bytes=s * v / t * (e + 4) + s * h * e,
            activation_bytes_recompute=s * v / t * (e + 4) + s * h * e, recomputable=False)
        blocks = [LayerSpec(**{**block.__dict__, "name": f"block{i}"}) for i in range(self.num_layers)]
        return [embedding, *blocks, head]


@dataclass(frozen=True)
class LlamaSpec:
    """Llama (``models.families.llama``): pre-RMSNorm blocks with grouped-query attention and a
    SwiGLU MLP, no biases, rotary positions (no position table), in Megatron's layout; key/value
    heads split over t, or one replicated per rank when t exceeds them."""

    name: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    seq_len: int
    vocab: int
    precision: str = "bf16"
    tie_embeddings: bool = False
    moe_keys: tuple[tuple[str, Any], ...] = ()   # model.moe as given (empty: dense)

    @property
    def moe(self) -> MoEConfig | None:
        return moe_config(self.model_cfg)

    @property
    def max_tp(self) -> int:
        return 1 if self.moe is not None else self.heads

    def allows_tp(self, tp: int) -> bool:
        """Whole query heads per rank, key/value heads split or replicated, the ffn split; MoE models
        at tp = 1 only (the MoE runtime has no tensor-parallel experts)."""
        if self.moe is not None:
            return tp == 1
        try:
            kv_heads_per_rank(self.heads, self.kv_heads, tp)
        except ConfigError:
            return False
        return self.ffn % tp == 0

    @property
    def model_cfg(self) -> dict[str, Any]:
        """The ``conf/model`` keys this spec stands for, as ``models.facts`` reads them."""
        return {"name": "llama", "num_layers": self.num_layers, "hidden_size": self.hidden, "num_heads": self.heads,
                "num_kv_heads": self.kv_heads, "ffn_hidden_size": self.ffn, "seq_len": self.seq_len,
                "vocab_size": self.vocab, "tie_embeddings": self.tie_embeddings,
                **({"moe": dict(self.moe_keys)} if self.moe_keys else {})}

    def num_parameters(self) -> int:
        return parameter_count(self.model_cfg)

    def num_active_parameters(self) -> int:
        """What one token goes through (top_k routed experts and the shared ones); the total if dense."""
        return llama_active_parameter_count(self.model_cfg)

    def flops_per_sample(self, recompute: bool) -> float:
        """The family's FLOP count (GQA and SwiGLU GEMMs, eq. 4.2's attention and logit terms)."""
        return flops_per_sample(self.model_cfg, recompute)

    def layer_specs(self, tp: int = 1) -> list[LayerSpec]:
        s, h, a, f, v, t = self.seq_len, self.hidden, self.heads, self.ffn, self.vocab, tp
        moe = self.moe
        if moe is not None and t != 1:
            raise PlannerError(f"model {self.name}: parallel.tp={t} but MoE models train at tp = 1; use planner.tp=1")
        if not self.allows_tp(t):
            raise PlannerError(f"model {self.name}: parallel.tp={t} does not split {a} heads, {self.kv_heads} "
                               f"key/value heads and ffn {f}")
        e = PRECISION_BYTES[self.precision]
        ar = 2 * (t - 1) / t
        kv_width = kv_heads_per_rank(a, self.kv_heads, t) * (h // a)   # this rank's K (and V) width
        # Saved for the backward, counted in 2-byte units as Korthikanti et al. count them: replicated
        # RMSNorm and GEMM inputs (8sh); this rank's q, attention output (4sh/t), k and v (4s kv_width);
        # gate, up, silu(gate) and their product (8sf/t); attention's fp32 log-sum-exp (4as/t). The
        # fused attention kernels behind F.scaled_dot_product_attention keep no s x s matrices.
        block_act = (s * (8 * h + (4 * h + 8 * f) / t + 4 * kv_width) + 4 * a * s / t) * e / 2
        gemm_weights = (2 * h * h + 3 * h * f) / t + 2 * h * kv_width
        block = LayerSpec(
            name="block", kind="block",
            forward_flops=2 * s * gemm_weights + 4 * s * s * h / t,
            gemm_flops=2 * s * h * h / t,
            memory_traffic_bytes=block_act,
            parameters=gemm_weights + 2 * h,
            output_bytes=s * h * e,
            activation_bytes=block_act,
            activation_bytes_recompute=s * h * e,
            tp_forward_bytes=2 * ar * s * h * e,   # g after O and after down
            tp_backward_bytes=2 * ar * s * h * e,  # f before QKV and before [gate; up]
            sequence_shardable_bytes=s * 8 * h * e / 2,   # the replicated RMSNorm and GEMM inputs
            attention_core_bytes=4 * a * s / t * e / 2,   # the log-sum-exp (the kernel's own saved state)
            attention_core_flops=4 * s * s * h / t,
            ring_bytes=2 * s * kv_width * e,   # only the key/value heads travel (GQA)
        )
        embedding = LayerSpec(
            name="embedding", kind="embedding", forward_flops=0.0, gemm_flops=0.0,
            memory_traffic_bytes=3 * s * h * e, parameters=v * h / t,
            output_bytes=s * h * e, activation_bytes=s * h, activation_bytes_recompute=s * h,
            tp_forward_bytes=ar * s * h * e, recomputable=False)
        head = LayerSpec(
            name="head", kind="head", forward_flops=2 * s * h * v / t, gemm_flops=2 * s * h * v / t,
            memory_traffic_bytes=s * v / t * (e + 4), parameters=v * h / t + h,
            output_bytes=4.0, activation_bytes=s * v / t * (e + 4) + s * h * e,
            activation_bytes_recompute=s * v / t * (e + 4) + s * h * e, recomputable=False)
        blocks = [moe_block(block, s, h, f, e, moe) if moe is not None and moe.is_moe_block(i) else block
                  for i in range(self.num_layers)]
        blocks = [LayerSpec(**{**b.__dict__, "name": f"block{i}"}) for i, b in enumerate(blocks)]
        return [embedding, *blocks, head]


def moe_block(dense: LayerSpec, s: int, h: int, ffn: int, e: int, moe: MoEConfig) -> LayerSpec:
    """A dense llama block (tp = 1) with its SwiGLU MLP replaced by the MoE MLP: parameters count
    every expert, FLOPs and kept activations what a token goes through (its top_k experts and the
    shared ones), plus each token's top_k copies of its input gathered for the experts; the
    dispatch and the combine each move s top_k h bytes per sample (moe_facts.moe_block_facts)."""
    active_ffn = moe.top_k * moe.expert_ffn + moe.shared_experts * moe.shared_ffn
    attention = dense.parameters - swiglu_parameters(h, ffn)
    act = dense.activation_bytes + (8 * s * (active_ffn - ffn) + 2 * s * moe.top_k * h) * e / 2
    routed = moe.num_experts * swiglu_parameters(h, moe.expert_ffn)
    return replace(dense, forward_flops=dense.forward_flops + 2 * s * (moe_mlp_active_parameters(h, moe)
                                                                       - swiglu_parameters(h, ffn)),
                   memory_traffic_bytes=act, activation_bytes=act,
                   parameters=attention + moe_mlp_parameters(h, moe), expert_parameters=float(routed),
                   alltoall_bytes=float(s * moe.top_k * h * e))


@dataclass(frozen=True)
class ChainSpec:
    """A model given directly as a chain of layers at tp = 1 (CNNs, MLPs)."""

    name: str
    layers: tuple[LayerSpec, ...]
    precision: str = "fp32"

    @property
    def max_tp(self) -> int:
        return 1

    def allows_tp(self, tp: int) -> bool:
        return tp == 1

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def num_parameters(self) -> int:
        return int(sum(layer.parameters for layer in self.layers))

    def flops_per_sample(self, recompute: bool) -> float:
        """Forward + backward (2x forward) + the recomputed forward when asked."""
        fwd = sum(layer.forward_flops for layer in self.layers)
        return fwd * (4 if recompute else 3)

    def layer_specs(self, tp: int = 1) -> list[LayerSpec]:
        if tp != 1:
            raise PlannerError(f"model {self.name} has no tensor-parallel layout; use tp = 1")
        return list(self.layers)


ModelSpec = TransformerSpec | LlamaSpec | ChainSpec


def vision_layer_spec(layer: VisionLayer, e: int) -> LayerSpec:
    """A layer of ``models.families.vision_facts`` (the trainable model's own description) as planner costs."""
    inp, out, inner = layer.input_elements, layer.output_elements, layer.inner_elements
    gemms = 4 if layer.kind == "bottleneck" and layer.downsample else 3 if layer.kind == "bottleneck" else 1
    return LayerSpec(layer.name, "layer", layer.forward_flops, layer.forward_flops / gemms, (inp + inner) * e,
                     layer.parameters, out * e, (inp + inner) * e, inp * e)


def vision_chain(cfg: Mapping[str, Any], precision: str) -> ChainSpec:
    e = PRECISION_BYTES[precision]
    return ChainSpec(str(cfg["name"]), tuple(vision_layer_spec(layer, e) for layer in vision_layers(cfg)), precision)


def vgg16(precision: str = "fp32", image: int = 224, classes: int = 1000, width_multiplier: float = 1.0) -> ChainSpec:
    """VGG-16 (Simonyan & Zisserman 2015): 13 convs (pools folded into the conv before) and 3 FCs."""
    return vision_chain({"name": "vgg16", "image_size": image, "num_classes": classes,
                         "width_multiplier": width_multiplier}, precision)


def resnet50(precision: str = "fp32", image: int = 224, classes: int = 1000, width_multiplier: float = 1.0) -> ChainSpec:
    """ResNet-50 v1.5 (He et al. 2016): stem, 16 bottleneck blocks, pooled classifier."""
    return vision_chain({"name": "resnet50", "image_size": image, "num_classes": classes,
                         "width_multiplier": width_multiplier}, precision)


def mlp(num_layers: int, hidden: int, precision: str = "fp32") -> ChainSpec:
    """The trainable MLP (models.families.mlp): ``num_layers`` residual blocks x + fc2(gelu(fc1(x))), h -> h."""
    e = PRECISION_BYTES[precision]
    flops = mlp_block_forward_flops(hidden)
    layer = LayerSpec("block", "block", flops, 2 * hidden * hidden, 4 * hidden * e, mlp_parameters(1, hidden),
                      hidden * e, 3 * hidden * e, hidden * e)
    return ChainSpec("mlp", tuple(LayerSpec(**{**layer.__dict__, "name": f"block{i}"}) for i in range(num_layers)),
                     precision)


def transformer_spec(cfg: Mapping[str, Any], label: str, precision: str) -> TransformerSpec:
    return TransformerSpec(label, str(cfg["name"]), int(cfg["num_layers"]), int(cfg["hidden_size"]),
                           int(cfg["num_heads"]), int(cfg["seq_len"]), int(cfg["vocab_size"]), precision,
                           bool(option(cfg, "tie_embeddings")), bool(option(cfg, "pre_ln")),
                           None if cfg.get("path") is None else str(cfg["path"]))


def llama_spec(cfg: Mapping[str, Any], label: str, precision: str) -> LlamaSpec:
    return LlamaSpec(label, int(cfg["num_layers"]), int(cfg["hidden_size"]), int(cfg["num_heads"]),
                     int(cfg["num_kv_heads"]), int(cfg["ffn_hidden_size"]), int(cfg["seq_len"]), int(cfg["vocab_size"]),
                     precision, bool(llama_option(cfg, "tie_embeddings")), _moe_keys(cfg))


def _moe_keys(cfg: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """model.moe as sorted pairs, checked (a broken key is one line); () when dense."""
    moe = cfg.get("moe")
    try:
        if moe is None or moe_config(cfg) is None:
            return ()
    except ConfigError as err:
        raise PlannerError(str(err)) from None
    return tuple(sorted((str(k), moe[k]) for k in moe.keys()))


def block_chain_spec(cfg: Mapping[str, Any], label: str, precision: str) -> ChainSpec:
    """Named after the family, not the preset, as ``mlp`` names it."""
    return mlp(int(cfg["num_layers"]), int(cfg["hidden_size"]), precision)


def vision_chain_spec(cfg: Mapping[str, Any], label: str, precision: str) -> ChainSpec:
    return ChainSpec(label, vision_chain(cfg, precision).layers, precision)


# A family's ``analytic_spec`` (``models.registry``) -> the builder of its spec: (cfg, label, precision)
SPEC_BUILDERS: Mapping[str, Callable[[Mapping[str, Any], str, str], ModelSpec]] = {
    TRANSFORMER_SPEC: transformer_spec, BLOCK_CHAIN_SPEC: block_chain_spec, VISION_CHAIN_SPEC: vision_chain_spec,
    LLAMA_SPEC: llama_spec}


def spec_from_config(cfg: Mapping[str, Any], default_precision: str = "fp32") -> ModelSpec:
    """``conf/model/*.yaml`` -> analytic spec. ``name`` is the family (``models.registry``)."""
    name = str(cfg.get("name", ""))
    precision = str(cfg.get("precision") or default_precision)
    if precision not in PRECISION_BYTES:
        raise PlannerError(f"model.precision={precision!r} is unknown; choose one of {sorted(PRECISION_BYTES)}")
    label = str(cfg.get("preset") or name)
    family = known_family(name)
    if family is None:
        *others, last = MODEL_FAMILIES
        raise PlannerError(f"model.name={name!r} is not known to the planner; choose {', '.join(others)} or {last}")
    build = SPEC_BUILDERS[family.analytic_spec]
    try:
        return build(cfg, label, precision)
    except KeyError as missing:
        raise PlannerError(f"model {label}: key model.{missing.args[0]} is missing for a {name} model") from None
