"""The dry run's text: the chosen plan as a table (a Harmony plan's in its own layout), the
alternatives and why they lost, and the end-to-end training time for a token budget (eq. 4.4)."""
from __future__ import annotations

from models.families.formulas import training_days
from pipedream.schedules import schedule_info

from planner.search.auto import Outcome
from planner.search.ranking import GIB, Candidate


def _split(c: Candidate, limit: int = 6) -> str:
    stages = [f"[{s},{e})x{len(r) // (c.tp * c.cp)}" for s, e, r in c.stages]
    if len(stages) > limit:
        stages = stages[: limit - 2] + [f"... ({len(stages) - limit + 2} more)"] + stages[-1:]
    return " ".join(stages)


def _bubble_rule(schedule: str) -> str:
    return schedule_info(schedule).bubble_rule


def _sim_line(sim, m: int) -> str:
    """The simulator's view: idle over busy time and peak in-flight, next to the formulas."""
    if not sim.ran:
        return sim.note
    if sim.per_input_predicted:
        return (f"steady state {sim.per_input_simulated:.4g} s per input simulated vs {sim.per_input_predicted:.4g} s "
                f"predicted without the all-reduce ({sim.per_input_simulated / sim.per_input_predicted - 1:+.1%}) over {sim.microbatches} "
                f"micro-batches; idle {sim.bubble_simulated:.0%} of busy time there (stage imbalance); peak in-flight "
                f"{max(sim.peak_in_flight)} {'matches' if sim.peak_in_flight == sim.peak_in_flight_formula else 'DIFFERS from'}"
                f" the formula ({max(sim.peak_in_flight_formula)})")
    steps = f", {sim.steps} steps: one fill and drain" if sim.steps > 1 else ""
    if sim.microbatches != m:
        steps += f" (not {m}, to stay interactive)"
    ok = "matches" if sim.peak_in_flight == sim.peak_in_flight_formula else "DIFFERS from"
    grad_sync = ""
    if sim.grad_sync_simulated is not None:
        grad_sync = (f"; overlapped gradient reduction exposed {sim.grad_sync_simulated:.4g} s (formula "
                     f"{sim.grad_sync_formula:.4g} s)")
    return (f"idle {sim.bubble_simulated:.2%} of busy time at m={sim.microbatches}{steps} (formula "
            f"{sim.bubble_formula:.2%}; the rest is stage imbalance and messages); peak in-flight "
            f"{max(sim.peak_in_flight)} {ok} the formula ({max(sim.peak_in_flight_formula)}){grad_sync}")


def count(n: float) -> str:
    """1.01T, 175B, 6.5M: three significant digits with a unit, never 1.01e+03B."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def _tflops(c: Candidate, peak_flops: float) -> str:
    """Both counts, labelled: the hardware FLOPs the devices run (eq. 4.2's 4 passes with
    recomputation, as Table 4.1; 3 without) and the model's (3 passes); none for a profile without
    FLOP counts (PipeDream's graph.txt)."""
    if c.model_tflops_per_device <= 0:
        return "n/a (the profile counts no FLOPs: PipeDream's graph.txt has times and sizes only)"
    share = f", {c.tflops_per_device * 1e12 / peak_flops:.0%} of peak" if peak_flops else ""
    passes = {"full": "eq. 4.2, 4 passes with recomputation as Table 4.1",
              "selective": "3 passes and the attention cores again", "none": "3 passes, nothing recomputed"}[
        c.recompute_granularity]
    return (f"{c.tflops_per_device:.4g} hardware ({passes}{share}), "
            f"{c.model_tflops_per_device:.4g} model (3 passes)")


def _memory(c: Candidate, reserve: float) -> str:
    used, usable = c.memory_bytes - reserve, c.capacity_bytes - reserve
    return (f"{used / GIB:.2f} of {usable / GIB:.2f} GiB usable ({used / usable:.0%}), + {reserve / GIB:.2f} GiB "
            f"reserve = {c.memory_bytes / GIB:.2f} / {c.capacity_bytes / GIB:.2f} GiB"
            + ("" if c.fits else " - OVER CAPACITY (planner.memory_constraint=false)"))


def _row(name: str, value: str) -> str:
    return f"  {name:<22} {value}"


def plan_table(outcome: Outcome, peak_flops: float) -> str:
    c, plan, sim = outcome.result.best, outcome.plan, outcome.sim
    n = plan.cluster.num_devices
    lines = [
        f"Plan for {plan.model.name} ({parameters_text(plan)}, {plan.model.num_layers} "
        f"layers) on {plan.cluster.name}: {n} x {plan.planner['device']}, global batch {c.global_batch}",
        f"  algorithm: {outcome.result.algorithm} ({outcome.result.considered} configurations) - {outcome.reason}",
        _row("degrees", f"pp={c.pp} tp={c.tp} cp={c.cp} dp={c.dp} vpp={c.vpp}"
                        f"{f' ep={c.ep}' if _moe(plan) or c.ep > 1 else ''}  ({plan.world_size} devices)"),
        _row("layer split x replicas", _split(c)),
        _row("micro-batch", f"b={c.micro}, m={c.num_microbatches} micro-batches per pipeline"),
        _row("schedule", c.schedule + (f" (v={c.vpp})" if c.vpp > 1 else "")),
        _row("recomputation", c.recompute_granularity),
        _row("memory savers", savers_text(c)),
        _row("iteration time", f"{c.iteration_time:.4g} s"),
        _row("throughput", f"{c.samples_per_s:.4g} samples/s"),
        _row("TFLOP/s per device", _tflops(c, peak_flops)),
        _row("memory per device", _memory(c, plan.planner.get("memory_reserve_bytes", 0.0))),
        *([_row("memory by part", memory_parts_text(c))] if c.memory_parts else []),
        _row("bubble", f"{c.bubble_fraction:.2%} of ideal time ({_bubble_rule(c.schedule)})"),
        _row("time per iteration", ", ".join(f"{k} {v:.3g} s" for k, v in c.breakdown.items() if v > 0)),
    ]
    lines += [_row(name, text) for name, text in (("context parallelism", cp_reason(c)), ("expert parallelism", ep_reason(c, plan)),
                                                ("ZeRO", zero_reason(c)))
              if text]
    lines.append(_row("simulator check", _sim_line(sim, c.global_batch // c.micro
                                               if schedule_info(c.schedule).updates_per_microbatch else c.num_microbatches)))
    for note in plan.planner.get("notes", []):
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def alternatives_table(outcome: Outcome) -> str:
    alts = outcome.result.alternatives
    if not alts:
        return "Alternatives: none (no other configuration fits)"
    head = f"  {'#':>2} {'configuration':<44} {'time s':>9} {'samples/s':>10} {'TFLOP/s':>8} {'GiB':>7}  why it lost"
    lines = ["Next best alternatives:", head]
    for i, a in enumerate(alts, 1):
        label = a.describe() if a.algorithm != "data-parallel" else f"data parallelism (d={a.dp} b={a.micro})"
        lines.append(f"  {i:>2} {label:<44} {a.iteration_time:>9.4g} {a.samples_per_s:>10.4g} "
                     f"{a.tflops_per_device:>8.4g} {a.memory_bytes / GIB:>7.2f}  {a.why_lost}")
    return "\n".join(lines)


def training_time(outcome: Outcome, tokens: float | None, seq_len: int | None) -> str:
    """Days for a token budget (``None``: no estimate): iterations x predicted iteration time. Eq. 4.4
    (8 T P / (n X)) is the same estimate when X counts 4 passes and its dropped terms are small; it is
    printed beside it as a check, never as a second estimate (6 T P / (n X) for a plan that
    recomputes nothing, whose X counts 3 passes)."""
    c, plan = outcome.result.best, outcome.plan
    if not seq_len:
        return "End-to-end training time: n/a (eq. 4.4 needs a sequence model; this one has no tokens)"
    if tokens is None:
        return "End-to-end training time: give a token budget (planner.train_tokens=300e9) for an estimate"
    iterations = tokens / (c.global_batch * seq_len)
    days = iterations * c.iteration_time / 86400
    line = (f"End-to-end training on {count(tokens)} tokens: {days:.1f} days ({iterations:.3g} iterations x "
            f"{c.iteration_time:.3g} s)")
    if c.tflops_per_device > 0:
        passes = 4 if c.recompute else 3   # what X counts (eq. 4.4 assumes 4: 8 = 2 x 4)
        eq44 = training_days(tokens, plan.model.num_parameters, plan.world_size, c.tflops_per_device * 1e12) * passes / 4
        line += (f"; eq. 4.4 ({2 * passes}TP/(nX), X = {c.tflops_per_device:.3g} hardware TFLOP/s) gives {eq44:.1f} "
                 f"days, {eq44 / days - 1:+.0%} from dropping s/6h and V/16lh")
    return line


def zero_shards(zero: int, ranks: int) -> str:
    """What a ZeRO level splits over the d x cp ranks: the optimizer state always, the rest only between steps."""
    return {1: f"optimizer state split {ranks} ways",
            2: f"optimizer state split {ranks} ways, no gradients between steps",
            3: f"optimizer state split {ranks} ways, and between steps the weights too and no gradients"}.get(zero, "")


def savers_text(c) -> str:
    """Which of sequence parallelism and the distributed optimizer (its ZeRO level) the plan takes."""
    zero = getattr(c, "zero", 1 if c.distributed_optimizer else 0)
    reshard = ", reshard_after_forward" if getattr(c, "reshard_after_forward", False) else ""
    taken = [name for name, on in (("sequence parallelism", c.sequence_parallel),
                                   (f"distributed optimizer (ZeRO-{zero}{reshard}: "
                                    f"{zero_shards(zero, c.dp * getattr(c, 'cp', 1))})", c.distributed_optimizer)) if on]
    return ", ".join(taken) or "none"


def _moe(plan) -> bool:
    return bool(plan.planner.get("active_parameters"))


def parameters_text(plan) -> str:
    """Total parameters, and for an MoE model the active ones (what a token goes through)."""
    total = f"{count(plan.model.num_parameters)} parameters"
    return f"{total}, {count(plan.planner['active_parameters'])} active" if _moe(plan) else total


def ep_reason(c: Candidate, plan) -> str:
    """How the plan splits the experts over the d x cp ranks and what the all-to-alls cost."""
    if not _moe(plan):
        return ""
    alltoall = c.breakdown.get("ep_comm", 0.0)
    exposed = (f"the MoE all-to-alls cost {alltoall:.3g} s per iteration beyond the compute they overlap"
               if alltoall > 0 else "no all-to-all time exposed" if c.ep > 1 else "no all-to-alls")
    split = (f"ep={c.ep}: each rank holds 1/{c.ep} of every MoE block's routed experts, taken from the "
             f"{c.dp * c.cp} d x cp ranks" if c.ep > 1 else "ep=1: every rank holds all experts")
    return f"{split}; {exposed}; tp > 1 is not searched (MoE layers train at tp=1)"


def memory_parts_text(c: Candidate) -> str:
    parts = c.memory_parts
    names = {"weights": "weights", "gradients": "gradients", "optimizer": "optimizer state", "activations": "activations"}
    return ", ".join(f"{names[k]} {v / GIB:.2f}" for k, v in parts.items()) + " GiB (the fullest rank)"


def cp_reason(c: Candidate) -> str:
    """Why the plan splits sequences: the activation memory it relieves (at cp = 1 with the same t, p
    and d each rank keeps c times the activations, and its ZeRO shards grow), or time where that fits too."""
    if c.cp <= 1 or "activations" not in c.memory_parts:
        return ""
    act = c.memory_parts["activations"]
    without = c.memory_bytes - act + act * c.cp
    head = (f"cp={c.cp}: each rank holds 1/{c.cp} of every sequence (zigzag chunks), activations {act / GIB:.2f} GiB "
            f"per rank instead of {act * c.cp / GIB:.2f} GiB at cp=1")
    ring = c.breakdown.get("cp_comm", 0.0)
    ring_text = (f"; the K/V ring costs {ring:.3g} s per iteration beyond the attention it overlaps" if ring > 0
                 else "; the attention blocks hide the K/V ring entirely")
    if without > c.capacity_bytes:
        return (f"{head}: relieves activation memory (at cp=1 a rank would need at least {without / GIB:.1f} GiB > "
                f"{c.capacity_bytes / GIB:.1f} GiB){ring_text}")
    return f"{head}: taken for time (cp=1 would fit too){ring_text}"


def zero_reason(c: Candidate) -> str:
    """ZeRO-2 and 3 are priced only where ZeRO-1 does not fit. They gather whole weights and accumulate
    whole gradients for the step, so they peak where ZeRO-1 does; only ZeRO-3 with
    reshard_after_forward, about two layers whole beside the shards, lowers the peak. The row says what the
    level holds at the peak and between steps."""
    zero = getattr(c, "zero", 0)
    if zero < 2 or not c.memory_parts:
        return ""
    shards = c.dp * c.cp
    between = f"; between steps {c.between_steps_bytes / GIB:.2f} GiB of model state" if c.between_steps_bytes else ""
    if not c.reshard_after_forward:
        return (f"ZeRO-{zero}: {zero_shards(zero, shards)} (the d x cp ranks that reduce gradients together); during "
                f"the step the weights and the gradients are whole, so the peak is ZeRO-1's{between}")
    # between steps ZeRO-3 holds the 1/(d cp) weight shard and the optimizer state: the stage's weights from it
    stage = (c.between_steps_bytes - c.memory_parts["optimizer"]) * shards
    held = c.memory_parts["weights"] + c.memory_parts["gradients"]
    below = c.memory_bytes - held + 2 * stage
    return (f"ZeRO-3 with optim.reshard_after_forward (fully sharded): each layer's weights are gathered over the "
            f"{shards} ranks (d x cp) for its forward and again for its backward and freed after, its gradients "
            f"reduce-scattered into the rank's 1/{shards} fp32 shard after each micro-batch; at the peak weights and "
            f"gradients {held / GIB:.2f} GiB (the shards, and whole: about two layers, the stage under a split backward) "
            f"instead of "
            f"{2 * stage / GIB:.2f} GiB for the stage's whole weights and gradients (at ZeRO-1 a rank would need {below / GIB:.1f} GiB > "
            f"{c.capacity_bytes / GIB:.1f} GiB); two all-gathers and a reduce-scatter per layer and micro-batch, "
            f"exposed beyond the neighbouring layer's compute (in the stage time, counted with dp_comm){between}")


# the table of a Harmony plan: the configuration (U_F, P_F, U_B, P_B), the estimate and the bytes it moves
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
        f"Plan for {plan.model.name} ({parameters_text(plan)}, {plan.model.num_layers} "
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
