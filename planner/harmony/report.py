"""The dry run's table for a Harmony plan: the configuration (U_F, P_F, U_B, P_B), the estimate and
the bytes it moves, in the layout of ``planner.report.plan_table``."""
from __future__ import annotations

from planner.search.auto import Outcome
from planner.search.ranking import GIB
from planner.report import _row, _tflops, count


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.3g} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.3g} MiB"


def _packs(packs, limit: int = 8) -> str:
    shown = [f"[{s},{e})" for s, e in packs]
    if len(shown) > limit:
        shown = shown[: limit - 2] + [f"... ({len(shown) - limit + 2} more)"] + shown[-1:]
    return f"{len(packs)} packs: " + " ".join(shown) if packs else "none (the jit pack holds every layer)"


def harmony_table(outcome: Outcome, peak_flops: float) -> str:
    c, plan, search = outcome.result.best, outcome.plan, outcome.harmony
    h, est, info = plan.harmony, search.best.estimate, plan.planner
    swaps = info["swap_bytes"]
    lines = [
        f"Plan for {plan.model.name} ({count(plan.model.num_parameters)} parameters, {plan.model.num_layers} "
        f"layers) on {plan.cluster.name}: {h.devices} x {info['device']}, global batch {c.global_batch}",
        f"  algorithm: harmony ({outcome.result.considered} configurations in {search.seconds:.3g} s) - "
        f"{outcome.reason}",
        _row("schedule", f"harmony_pp: wrap-around pipeline over {h.devices} devices (task i on device i mod "
                         f"{h.devices})"),
        _row("micro-batch", f"b={c.micro}, m={c.num_microbatches} micro-batches per iteration"),
        _row("forward", f"U_F={h.forward_group} micro-batches per task group, P_F {_packs(h.forward_packs)}"),
        _row("backward", f"U_B={h.backward_group} micro-batches per task group, P_B {_packs(h.backward_packs)} "
                         f"(the last, shared with P_F, is the jit pack)"),
        _row("recomputation", "per backward pack from its stashed input (the jit pack keeps its activations)"),
        _row("iteration time", f"{c.iteration_time:.4g} s (event-driven estimate)"),
        _row("throughput", f"{c.samples_per_s:.4g} samples/s"),
        _row("TFLOP/s per device", _tflops(c, peak_flops)),
        _row("device memory", f"peak {_size(max(est.peak_bytes))} of the {_size(h.device_budget_bytes)} budget with "
                              f"activations, {_size(max(est.peak_managed_bytes))} of weights, gradients and stashes "
                              f"(per device: {', '.join(_size(b) for b in est.peak_bytes)})"),
        _row("idle", f"{c.bubble_fraction:.1%} of device time not computing (swaps, sends, pipeline fill)"),
        _row("bytes moved", f"weights in {_size(swaps['weights_in'])}, gradients out "
                            f"{_size(swaps['gradients_out'])} (|W| = {_size(info['weight_bytes'])}), "
                            f"stashes {_size(swaps['stashes_each_way'])} each way, device-to-device "
                            f"{_size(swaps['device_to_device'])}"),
    ]
    for note in info.get("notes", []):
        lines.append(f"  note: {note}")
    return "\n".join(lines)
