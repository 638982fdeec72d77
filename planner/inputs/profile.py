"""Per-layer profiles: the planner's only view of a model's costs.

JSON schema ``pipedream-profile/1`` (times in seconds, sizes in bytes, "per sample" = per
sequence or image; times are for a whole micro-batch of each size in ``micro_batch_sizes``)::

    {"schema": "pipedream-profile/1", "model": str, "device": str,
     "source": "measured" | "analytic" | "graph.txt", "precision": "fp32" | "bf16" | ...,
     "tensor_parallel": int, "micro_batch_sizes": [int, ...],
     "num_parameters": int, "flops_per_sample": float, "flops_per_sample_recompute": float,
     "layers": [{"name": str, "kind": "embedding" | "block" | "head" | "layer",
                 "forward_s": [float per micro-batch size], "backward_s": [...],
                 "output_bytes": float,            # per sample, sent to the next stage
                 "parameter_bytes": float, "optimizer_bytes": float,
                 "activation_bytes": float,        # per sample, kept for backward
                 "activation_bytes_recompute": float,  # per sample, kept with recomputation
                 "flops": float,                   # forward, per sample (0 if unknown)
                 "tp_forward_bytes": float, "tp_backward_bytes": float,  # per sample
                 "recomputable": bool,
                 # optional (0 when absent), per sample, parts of activation_bytes:
                 "sequence_shardable_bytes": float,  # sharded t ways by sequence parallelism
                 "attention_core_bytes": float,      # dropped by selective recomputation ...
                 "attention_core_flops": float,      # ... whose forward FLOPs it repeats
                 "ring_bytes": float,                # K and V over the sequence: context parallelism's ring
                 "expert_parameter_bytes": float,    # MoE: of parameter_bytes, the routed experts' ...
                 "expert_optimizer_bytes": float,    # ... and of optimizer_bytes (split ep ways)
                 "alltoall_bytes": float}, ...],     # MoE: per sample, one dispatch (or combine)
     "num_active_parameters": int, "num_experts": int}   # optional, MoE models (0: dense)

Times between measured micro-batch sizes are interpolated linearly; above the largest the last
segment is extended (a linear fit), below the smallest they scale in proportion to the size.

Sources: ``analytic_profile`` (spec + device sheet, here), ``planner.calibrate.measure`` (run the model on
this device: ``python -m planner.profile model=...``), ``planner.inputs.graph_txt`` (PipeDream's format).
"""
from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path

import numpy as np

from pipedream.devices import DeviceSheet

from planner.errors import ProfileError
from planner.inputs.model_specs import ModelSpec, parameter_bytes

SCHEMA = "pipedream-profile/1"
ANALYTIC_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048)


@dataclass(frozen=True)
class LayerProfile:
    name: str
    kind: str
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    output_bytes: float
    parameter_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    activation_bytes_recompute: float
    flops: float = 0.0
    tp_forward_bytes: float = 0.0
    tp_backward_bytes: float = 0.0
    recomputable: bool = True
    sequence_shardable_bytes: float = 0.0  # per sample: of activation_bytes, what sequence parallelism shards
    attention_core_bytes: float = 0.0      # per sample: of activation_bytes, what selective recomputation drops
    attention_core_flops: float = 0.0      # per sample: the forward FLOPs selective recomputation repeats
    ring_bytes: float = 0.0                # per sample: K and V over the sequence (context parallelism's ring)
    expert_parameter_bytes: float = 0.0    # of parameter_bytes: the routed experts' (split over ep ranks)
    expert_optimizer_bytes: float = 0.0    # of optimizer_bytes: the routed experts'
    alltoall_bytes: float = 0.0            # per sample: what one all-to-all (dispatch or combine) moves


@dataclass(frozen=True)
class Profile:
    model: str
    device: str
    source: str
    precision: str
    tensor_parallel: int
    micro_batch_sizes: tuple[int, ...]
    layers: tuple[LayerProfile, ...]
    num_parameters: int = 0
    flops_per_sample: float = 0.0
    flops_per_sample_recompute: float = 0.0
    num_active_parameters: int = 0   # MoE: parameters one token goes through (0: as num_parameters)
    num_experts: int = 0             # MoE: routed experts per MoE block (0: dense)
    schema: str = field(default=SCHEMA)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ProfileError(f"profile of {self.model} has no layers")
        sizes = list(self.micro_batch_sizes)
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ProfileError(f"profile micro_batch_sizes = {sizes} must be increasing positive integers")
        for layer in self.layers:
            if len(layer.forward_s) != len(sizes) or len(layer.backward_s) != len(sizes):
                raise ProfileError(f"profile layer {layer.name}: {len(layer.forward_s)} forward times for "
                                   f"{len(sizes)} micro-batch sizes")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @cached_property
    def _time_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        xs = np.asarray(self.micro_batch_sizes, dtype=float)
        fwd = np.array([layer.forward_s for layer in self.layers], dtype=float)
        bwd = np.array([layer.backward_s for layer in self.layers], dtype=float)
        return xs, fwd, bwd

    @cached_property
    def arrays(self) -> dict[str, np.ndarray]:
        """Per-layer columns as float arrays (N,), for vectorised searches."""
        names = ("output_bytes", "parameter_bytes", "optimizer_bytes", "activation_bytes",
                 "activation_bytes_recompute", "flops", "tp_forward_bytes", "tp_backward_bytes",
                 "sequence_shardable_bytes", "attention_core_bytes", "attention_core_flops", "ring_bytes",
                 "expert_parameter_bytes", "expert_optimizer_bytes", "alltoall_bytes")
        cols = {n: np.array([getattr(layer, n) for layer in self.layers], dtype=float) for n in names}
        cols["recomputable"] = np.array([layer.recomputable for layer in self.layers], dtype=bool)
        return cols

    def times(self, micro_batch: float) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward seconds per layer (N,) for one micro-batch of ``micro_batch`` samples."""
        fwd, bwd = self.times_many([micro_batch])
        return fwd[0], bwd[0]

    def times_many(self, micro_batches) -> tuple[np.ndarray, np.ndarray]:
        """(len(micro_batches), N) forward and backward seconds; interpolation rules in the module doc."""
        xs, fwd, bwd = self._time_table
        bs = np.asarray(list(micro_batches), dtype=float)
        return _interp(bs, xs, fwd), _interp(bs, xs, bwd)

    def to_json(self) -> dict:
        out = asdict(self)
        out["micro_batch_sizes"] = list(self.micro_batch_sizes)
        return {"schema": SCHEMA, **{k: v for k, v in out.items() if k != "schema"}}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def _interp(bs: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Piecewise-linear in the micro-batch size; (len(bs), N) from points xs (K,) and ys (N, K)."""
    if len(xs) == 1:
        return (bs[:, None] / xs[0]) * ys[None, :, 0]
    idx = np.clip(np.searchsorted(xs, bs, side="right") - 1, 0, len(xs) - 2)
    x0, x1 = xs[idx], xs[idx + 1]
    w = (bs - x0) / (x1 - x0)
    out = ys[:, idx].T * (1 - w[:, None]) + ys[:, idx + 1].T * w[:, None]
    below = bs < xs[0]
    if below.any():
        out[below] = (bs[below, None] / xs[0]) * ys[None, :, 0]
    return np.maximum(out, 0.0)


def profile_from_json(data: dict) -> Profile:
    if data.get("schema") != SCHEMA:
        raise ProfileError(f"profile schema is {data.get('schema')!r}, expected {SCHEMA!r}")
    known = {f.name for f in fields(LayerProfile)}
    try:
        layers = tuple(LayerProfile(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in layer.items()
                                        if k in known}) for layer in data["layers"])
        top = {f.name for f in fields(Profile)} - {"layers", "schema", "micro_batch_sizes"}
        return Profile(layers=layers, micro_batch_sizes=tuple(data["micro_batch_sizes"]),
                       **{k: v for k, v in data.items() if k in top})
    except (KeyError, TypeError) as err:
        raise ProfileError(f"profile JSON is missing or mistypes a field: {err}") from None


def mean_profile(profiles: list[dict]) -> dict:
    """Timings of the same model's layers (profile JSON) averaged layer by layer: the processes that
    profiled it at once, or one process's timings at several moments."""
    import statistics   # here: a plan from a preset or graph.txt does not average profiles

    out = copy.deepcopy(profiles[0])
    for i, layer in enumerate(out["layers"]):
        for key in ("forward_s", "backward_s"):
            layer[key] = [statistics.fmean(p["layers"][i][key][k] for p in profiles) for k in range(len(layer[key]))]
    return out


def load_profile(path: str | Path) -> Profile:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ProfileError(f"profile file {path} does not exist") from None
    except json.JSONDecodeError as err:
        raise ProfileError(f"profile file {path} is not JSON: {err}") from None
    return profile_from_json(data)


def efficiency(gemm_flops: np.ndarray, device: DeviceSheet) -> np.ndarray:
    """Fraction of peak a GEMM of this size reaches: e_max x / (x + x_half) (saturating fit, docs/planner.md)."""
    x = np.asarray(gemm_flops, dtype=float)
    return device.matmul_efficiency * x / (x + device.half_efficiency_flops)


def analytic_profile(spec: ModelSpec, device: DeviceSheet, tp: int = 1,
                     micro_batch_sizes: tuple[int, ...] = ANALYTIC_SIZES) -> Profile:
    """Times from FLOPs over achievable FLOP/s plus memory traffic over bandwidth (ch. 3.3.3's
    extrapolation from per-block costs); backward = 2x forward (ch. 4.5.1)."""
    layers = spec.layer_specs(tp)
    peak = device.flops(spec.precision)
    # the cost model counts weights x (versions + 1) (the +1: the gradients, as large as the
    # weights) plus optimizer_bytes: the master copy and the optimizer state
    per_param = parameter_bytes(spec.precision)
    weight_bytes, opt = per_param.weights, per_param.master + per_param.optimizer
    bs = np.asarray(micro_batch_sizes, dtype=float)
    out = []
    for layer in layers:
        flops = layer.forward_flops * bs
        eff = efficiency(layer.gemm_flops * bs, device) if layer.gemm_flops > 0 else np.ones_like(bs)
        compute = np.where(flops > 0, flops / (peak * np.maximum(eff, 1e-9)), 0.0)
        memory = layer.memory_traffic_bytes * bs / device.memory_bandwidth
        fwd = compute + memory
        out.append(LayerProfile(
            layer.name, layer.kind, tuple(fwd.tolist()), tuple((2 * fwd).tolist()), layer.output_bytes,
            layer.parameters * weight_bytes, layer.parameters * opt, layer.activation_bytes,
            layer.activation_bytes_recompute, layer.forward_flops, layer.tp_forward_bytes,
            layer.tp_backward_bytes, layer.recomputable, layer.sequence_shardable_bytes,
            layer.attention_core_bytes, layer.attention_core_flops, layer.ring_bytes,
            layer.expert_parameters * weight_bytes, layer.expert_parameters * opt, layer.alltoall_bytes))
    moe = getattr(spec, "moe", None)
    return Profile(spec.name, device.name, "analytic", spec.precision, tp, tuple(micro_batch_sizes), tuple(out),
                   spec.num_parameters(), spec.flops_per_sample(False), spec.flops_per_sample(True),
                   spec.num_active_parameters() if moe is not None else 0, moe.num_experts if moe is not None else 0)

