"""Measure a profile on this device: ``python -m planner.profile model=gpt_tiny planner.profile_out=p.json``
(or ``model._target_=my_pkg.mod.build`` for a plugin model, docs/models.md).

Each layer of ``models.build_model(cfg.model)`` runs alone on the previous layer's output (the last
one with the loss): forward and backward times after warm-up, median of repeats (CUDA events on a
GPU, ``perf_counter`` on a CPU), the bytes autograd saves for backward (saved-tensor hooks, without
parameters), the output bytes, parameter bytes, and forward FLOPs (``torch.utils.flop_counter``).
A layer that passes a tuple of tensors on counts every member's bytes; its backward starts from
every floating-point member.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Sequence

from models.family import plain_layer_kinds
from models.registry import known_family

from planner.errors import PlannerError
from planner.inputs.profile import LayerProfile, Profile

ADAM_STATE_PER_WEIGHT = 2.0  # AdamW keeps m and v, each the size of the weights


def _timer(device: Any):
    import torch

    if device.type == "cuda":
        def timed(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize(device)
            return out, start.elapsed_time(end) / 1000.0
    else:
        def timed(fn):
            t0 = time.perf_counter()
            out = fn()
            return out, time.perf_counter() - t0
    return timed


def _saved_bytes(fn, params: set[int]):
    """Run ``fn`` under saved-tensor hooks; bytes of distinct non-parameter storages autograd keeps."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        if t.data_ptr() not in params:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, float(sum(seen.values()))


def measure_layer(layer, inp, run, timed, warmup: int, repeats: int):
    """(forward s, backward s, output, saved bytes, flops) of one layer at one micro-batch size;
    ``inp`` and the output are a tensor or a tuple of tensors (``models.boundary``)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from models.boundary import carries_grad, tensors

    params = {p.data_ptr() for p in layer.parameters()}

    def fresh():
        x = tuple(t.detach().requires_grad_(carries_grad(t)) for t in tensors(inp))
        return x, run(layer, x if isinstance(inp, tuple) else x[0])

    def backward(out):
        outs = [t for t in tensors(out) if t.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    fwd_times, bwd_times = [], []
    for i in range(warmup + repeats):
        (x, out), t_fwd = timed(fresh)
        _, t_bwd = timed(lambda: backward(out))
        layer.zero_grad(set_to_none=True)
        if i >= warmup:
            fwd_times.append(t_fwd)
            bwd_times.append(t_bwd)
    (_, out), saved = _saved_bytes(fresh, params)
    with FlopCounterMode(display=False) as counter:
        fresh()
    from models.boundary import detach
    return statistics.median(fwd_times), statistics.median(bwd_times), detach(out), saved, counter.get_total_flops()


def measure_profile(model_cfg: Any, micro_batches: Sequence[int], device_name: str | None = None,
                    warmup: int = 2, repeats: int = 5, tp: Any = None) -> Profile:
    """``tp``: a ``TensorParallel`` context: this rank's shard of every layer, timed with its
    all-reduces (every rank of the group measures the same layers at the same time)."""
    import torch

    from models import build_model
    from models.boundary import call_layer, nbytes, to_device

    device = torch.device(device_name or ("cuda" if torch.cuda.is_available() else "cpu"))
    spec = build_model(model_cfg, tp=tp)
    layers = spec.build()
    for module in layers.values():
        module.to(device).train()
    timed = _timer(device)
    n = spec.num_layers
    rows: list[dict] = [dict(forward_s=[], backward_s=[]) for _ in range(n)]
    gen = torch.Generator().manual_seed(0)
    for b in micro_batches:
        x, y = spec.make_batch(b, gen)
        inp, target = to_device(x, device), to_device(y, device)
        for i in range(n):
            last = i == n - 1
            run = (lambda m, t: spec.loss_fn(call_layer(m, t), target)) if last else call_layer
            fwd, bwd, out, saved, flops = measure_layer(layers[i], inp, run, timed, warmup, repeats)
            row = rows[i]
            row["forward_s"].append(fwd)
            row["backward_s"].append(bwd)
            row.update(output_bytes=0.0 if last else nbytes(out) / b,
                       activation_bytes=saved / b, activation_bytes_recompute=nbytes(inp) / b,
                       flops=flops / b)
            inp = out
    family = known_family(model_cfg.get("name"))   # None for a plugin
    kinds = family.layer_kinds(n) if family is not None else plain_layer_kinds(n)
    profile_layers = []
    for i, row in enumerate(rows):
        weights = float(sum(p.numel() * p.element_size() for p in layers[i].parameters()))
        profile_layers.append(LayerProfile(
            name=f"{kinds[i]}{i}", kind=kinds[i], forward_s=tuple(row["forward_s"]), backward_s=tuple(row["backward_s"]),
            output_bytes=row["output_bytes"], parameter_bytes=weights, optimizer_bytes=ADAM_STATE_PER_WEIGHT * weights,
            activation_bytes=row["activation_bytes"], activation_bytes_recompute=row["activation_bytes_recompute"],
            flops=row["flops"], recomputable=kinds[i] in ("block", "layer")))
    params = sum(p.numel() for p in spec.build_sequential().parameters())
    fwd_flops = sum(layer.flops for layer in profile_layers)
    label = model_cfg.get("preset") or model_cfg.get("name") or model_cfg.get("_target_")
    return Profile(str(label), _device_label(device), "measured", "fp32", 1 if tp is None else tp.size,
                   tuple(int(b) for b in micro_batches), tuple(profile_layers), int(params), 3 * fwd_flops,
                   4 * fwd_flops)


def _device_label(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def check_batch_norm_batches(model_cfg: Any, micro_batches: list[int]) -> None:
    family = known_family(model_cfg.get("name"))
    if family is not None and family.normalised_values is not None:
        too_small = [b for b in micro_batches if family.normalised_values(model_cfg, int(b)) < 2]
        if too_small:
            raise PlannerError(f"planner.profile_micro_batches={list(micro_batches)}: micro-batches of {too_small} "
                               f"give {model_cfg['name']}'s BatchNorm one value per channel at its last blocks; "
                               f"profile larger ones, e.g. planner.profile_micro_batches=[2,4,8]")


def trainable_config(argv: Sequence[str] | None, verb: str) -> Any:
    """The composed config of a command that runs the model; planner-only presets and plugins that do
    not import, chain or reduce their loss refused in one line."""
    from planner.config import compose

    cfg = compose(sys.argv[1:] if argv is None else argv)
    if cfg.model.get("planner_only"):
        raise PlannerError(f"model={cfg.model.get('preset') or cfg.model.get('name')} is planner-only (analytic); "
                           f"{verb} a trainable model (gpt_tiny, gpt_small, mlp)")
    if cfg.model.get("_target_"):
        from models.plugins import checked_model
        checked_model(cfg.model)
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    from pipedream.errors import ConfigError

    try:
        cfg = trainable_config(argv, "measure")
        p = cfg.planner
        check_batch_norm_batches(cfg.model, list(p.profile_micro_batches))
        profile = measure_profile(cfg.model, list(p.profile_micro_batches), p.get("profile_device"),
                                  int(p.profile_warmup), int(p.profile_repeats))
    except (PlannerError, ValueError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    profile.save(str(p.profile_out))
    total = sum(layer.forward_s[-1] + layer.backward_s[-1] for layer in profile.layers)
    print(f"wrote {p.profile_out}: {profile.num_layers} layers of {profile.model} on {profile.device}, "
          f"{total * 1e3:.2f} ms forward+backward at micro-batch {profile.micro_batch_sizes[-1]}")
    return 0
