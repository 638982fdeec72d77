"""``python -m pipedream.schedules``: print a schedule as a rank x time grid (unit costs).

Example: ``python -m pipedream.schedules --schedule interleaved --pp 2 --vpp 2 --microbatches 4``.
Cells are ``F3``/``B3``/``W3`` (micro-batch 3; W is a weight gradient, listed by the zero-bubble
schedules or held back from a backward with ``--weight-grad-cost``), with the chunk as a letter
when a rank has several (``F3a`` is chunk 0, ``F3b`` chunk 1); ``.`` is idle. Bad input: one line
on stderr, exit code 2.

``--schedule harmony_pp`` prints Harmony's task table and each device's action list instead
(``--pp`` devices, ``--layers``, ``--forward-packs 2,2,1`` ... ; see pipedream/schedules/harmony.py):
``python -m pipedream.schedules --schedule harmony_pp --pp 2 --microbatches 4 --layers 6``.
"""
from __future__ import annotations

import argparse
import math
import string
import sys

from pipedream.schedules import (ASYNC_SCHEDULES, HARMONY_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, ScheduleError,
                                 all_schedules, build_schedule, harmony_config, harmony_pp, schedule_placement)
from pipedream.schedules.actions import Action, Kind, format_actions
from pipedream.schedules.harmony import describe
from pipedream.schedules.registry import schedule_info
from pipedream.schedules.simulate import Costs, SimResult, simulate


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise _UsageError(message)


def chunk_letter(chunk: int) -> str:
    return string.ascii_lowercase[chunk] if chunk < 26 else f".{chunk}"


def cell_label(action: Action, vpp: int, weight_grads: bool = False) -> str:
    """``weight_grads``: the held-back weight-gradient part of a BWD, drawn as W like a WEIGHT."""
    if action.microbatch < 0:  # SYNC_GRADS, STEP (zero duration unless costed)
        return action.kind.value[:2]
    kind = Kind.WEIGHT.value if weight_grads else action.kind.value
    return f"{kind}{action.microbatch}{chunk_letter(action.chunk) if vpp > 1 else ''}"


def grid(result: SimResult) -> str:
    """One row per rank, one column per unit time slot; '.' where the rank is idle."""
    slots = math.ceil(result.iteration_time - 1e-9)
    rows = []
    for timeline in result.timelines:
        row = ["."] * slots
        for item in timeline:
            for t in range(math.floor(item.start + 1e-9), math.ceil(item.end - 1e-9)):
                row[t] = cell_label(item.action, result.vpp, item.weight_grads)
        rows.append(row)
    width = max([len(c) for row in rows for c in row] + [1])
    head_width = len(f"rank {len(rows) - 1}")
    header = "t".ljust(head_width) + " " + " ".join(
        (str(t) if len(str(t)) <= width and (width > 2 or t % 5 == 0) else "").ljust(width) for t in range(slots))
    lines = [header.rstrip()]
    for rank, row in enumerate(rows):
        lines.append(f"rank {rank}".ljust(head_width) + " " + " ".join(c.ljust(width) for c in row).rstrip())
    return "\n".join(lines)


def summary(result: SimResult, microbatches: int, fill_share: float | None = None) -> str:
    """``fill_share``: for schedules with W actions, t_f / (t_f + t_b + t_w), so the printed
    reference is the flush's unavoidable fill, (p-1) chunk forwards, instead of 1F1B's bubble."""
    p, v = result.pp, result.vpp
    per_rank = " ".join(str(n) for n in result.peak_in_flight)
    if fill_share is None:
        reference = f"[(p-1)/(v*m) = {(p - 1) / (v * microbatches):.4f}]"
    else:
        reference = f"[fill only, (p-1)*t_f/(v*m*(t_f+t_b+t_w)) = {(p - 1) * fill_share / (v * microbatches):.4f}]"
    lines = [
        f"iteration time: {result.iteration_time:g} units",
        f"bubble fraction (idle / ideal compute): {result.bubble_fraction:.4f}   {reference}",
        f"idle fraction (idle / iteration time): {result.idle_fraction:.4f}",
        f"peak in-flight micro-batches per rank{' (counted per chunk)' if v > 1 else ''}"
        f"{', until their W' if fill_share is not None else ''}: {per_rank}",
    ]
    if fill_share is not None:
        lines.insert(2, f"steady-state bubble (no synchronisation at the step): {result.steady_bubble_fraction:.4f}")
    if v > 1:
        lines.append("chunks: " + " ".join(f"{chunk_letter(c)}={c}" for c in range(v)))
    return "\n".join(lines)


def _sizes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ScheduleError(f"{text!r}: give layers per pack as comma-separated integers, e.g. 2,2,1") from None


def harmony_text(args) -> str:
    """Harmony's task table, then each device's actions in order (harmony_dp: the one list every
    device runs over its own micro-batches)."""
    if args.layers is None:
        raise ScheduleError(f"--schedule {args.schedule} needs --layers (the model's layer count)")
    devices = 1 if schedule_info(args.schedule).replicated_packs else args.pp
    config = harmony_config(args.layers, args.microbatches, devices, _sizes(args.forward_packs),
                            _sizes(args.backward_packs), args.forward_group, args.backward_group)
    lines = [describe(config)]
    lines += [f"device {d}: {format_actions(actions)}" for d, actions in enumerate(harmony_pp(config))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m pipedream.schedules", description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", required=True,
                        help=f"one of {', '.join(sorted(all_schedules()) + sorted(HARMONY_SCHEDULES))}")
    parser.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches per iteration")
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per rank (interleaved)")
    parser.add_argument("--steps", type=int, default=1,
                        help="steps of the run (pipedream and 2bw never flush, so their lists span the run)")
    parser.add_argument("--backward-cost", type=float, default=1.0,
                        help="backward (input-gradient part) time / forward time")
    parser.add_argument("--weight-grad-cost", type=float, default=None,
                        help="weight-gradient time / forward time, added to the backward (default 1 for "
                             "the zero-bubble schedules, which list W; 0 for the others, whose backward is whole)")
    parser.add_argument("--png", help="also draw the timeline to this PNG file")
    parser.add_argument("--layers", type=int, help="harmony_pp: the model's layer count")
    parser.add_argument("--forward-packs", help="harmony_pp: layers per forward pack, e.g. 2,2,1 (default 1 each)")
    parser.add_argument("--backward-packs", help="harmony_pp: layers per backward pack (default 1 each)")
    parser.add_argument("--forward-group", type=int, help="harmony_pp: micro-batches per forward task (default all)")
    parser.add_argument("--backward-group", type=int, help="harmony_pp: micro-batches per backward task (default all)")
    try:
        args = parser.parse_args(argv)
        if args.schedule in HARMONY_SCHEDULES:
            print(harmony_text(args))
            return 0
        if not args.backward_cost > 0:
            raise ScheduleError(f"--backward-cost = {args.backward_cost} must be > 0")
        explicit_w = args.schedule in SPLIT_BACKWARD_SCHEDULES
        weight = args.weight_grad_cost if args.weight_grad_cost is not None else float(explicit_w)
        if weight < 0:
            raise ScheduleError(f"--weight-grad-cost = {weight} must be >= 0")
        schedule = build_schedule(args.schedule, args.pp, args.microbatches, args.vpp, args.steps)
        placement = schedule_placement(args.schedule, args.pp, args.vpp)
        costs = Costs(forward=1.0, backward=args.backward_cost + weight, weight_grad=weight)
        result = simulate(schedule, costs, vpp=placement.vpp, peer=placement.peer, needs=placement.needs)
        print(grid(result))
        run_microbatches = args.microbatches * (args.steps if args.schedule in ASYNC_SCHEDULES else 1)
        share = 1.0 / (1.0 + args.backward_cost + weight) if explicit_w else None
        print(summary(result, run_microbatches, share))
        if placement.kind != "round-robin":
            held = "; ".join(f"rank {r}: " + ",".join(str(placement.virtual_stage(r, c)) for c in range(placement.vpp))
                             for r in range(args.pp))
            print(f"placement {placement.kind}, virtual stages held by each rank (chunk a, b, ...): {held}")
        if args.png:
            from pipedream.schedules.timeline_plot import plot_timeline, spans_from_sim

            title = f"{args.schedule} pp={args.pp} vpp={placement.vpp} m={args.microbatches}"
            plot_timeline(spans_from_sim(result), args.png, title)
            print(f"wrote {args.png}")
    except (_UsageError, ScheduleError, ImportError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
