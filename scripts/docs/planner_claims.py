"""The dissertation's fits / out-of-memory statements and scaling trends (ch. 4.5), each with the
planner's verdict beside it, as markdown for docs/planner.md (scripts/docs/planner.py calls it).
Run alone to print: .venv/bin/python -m scripts.docs.planner_claims
"""
from __future__ import annotations

import re
from dataclasses import replace

from planner.config import compose, inputs_from_config
from planner.errors import PlannerError
from planner.search.ptdp import ptdp_search
from planner.search.ranking import GIB

GPT_5_9B = ["model=gpt_1.7b", "model.num_layers=32", "model.hidden_size=3840", "model.num_heads=32"]
GPT_162B = ["model=gpt_1.7b", "model.num_layers=32", "model.hidden_size=20480", "model.num_heads=128"]
TABLE_4_1 = [("gpt_1.7b", 32, 512, 1, 1), ("gpt_3.6b", 64, 512, 2, 1), ("gpt_7.5b", 128, 512, 4, 1),
             ("gpt_18.4b", 256, 1024, 8, 1), ("gpt_39.1b", 512, 1536, 8, 2), ("gpt_76.1b", 1024, 1792, 8, 4),
             ("gpt_145.6b", 1536, 2304, 8, 8), ("gpt_310.1b", 1920, 2160, 8, 16), ("gpt_529.6b", 2520, 2520, 8, 35),
             ("gpt_1t", 3072, 3072, 8, 64)]


def plan(model: list[str], gpus: int, batch: int, t: int, p: int, recompute: bool, micro: int | None = None,
         schedules: tuple[str, ...] | None = None):
    """The best configuration with these pins on DGX A100 nodes, or the PlannerError's text."""
    over = model + ["cluster=dgx_a100", f"cluster.nodes={max(gpus // 8, 1)}", f"train.global_batch_size={batch}"]
    if micro:
        over.append(f"train.micro_batch_size={micro}")
    inputs = replace(inputs_from_config(compose(over)).as_in_the_dissertation(), pin_tp=t, pin_pp=p, recompute=(recompute,))
    if schedules:
        inputs = replace(inputs, schedules=schedules)
    try:
        return ptdp_search(inputs).best, inputs
    except PlannerError as err:
        return str(err), inputs


def verdict(result) -> str:
    best, inputs = result
    usable = (inputs.capacity - inputs.workspace) / GIB
    if isinstance(best, str):
        need = re.search(r"needs ([\d.]+) GiB", best)
        return (f"does not fit: {float(need.group(1)) - inputs.workspace / GIB:.1f} GiB > {usable:.1f} GiB usable"
                if need else f"no plan: {best}")
    return f"fits: {(best.memory_bytes - inputs.workspace) / GIB:.1f} of {usable:.1f} GiB usable (b={best.micro})"


def fits(result) -> bool:
    return not isinstance(result[0], str)


def memory_rows() -> list[tuple[str, str, str, bool]]:
    """(where, the dissertation's statement, the planner's verdict, agrees)."""
    rows = []
    for preset, gpus, batch, t, p in TABLE_4_1:
        r = plan([f"model={preset}"], gpus, batch, t, p, True)
        rows.append((f"Table 4.1, {preset}", f"(t, p) = ({t}, {p}), {gpus} GPUs, batch {batch}, recomputation: ran",
                     verdict(r), fits(r)))
    largest = None
    for batch in (1, 2, 4, 8, 16, 32, 64, 128):
        r = plan(["model=gpt_145.6b"], 128, batch, 8, 16, False, 1, ("1f1b",))
        if fits(r):
            largest = batch
        else:
            rows.append(("Fig. 4.17, 145.6B (8, 16), 128 GPUs", "without recomputation only small batches fit; "
                         "recomputation is needed for larger ones",
                         f"no recompute (b=1, 1F1B) fits up to batch {largest}; batch {batch}: {verdict(r)}",
                         largest is not None and largest < 64))
            break
    else:
        rows.append(("Fig. 4.17, 145.6B (8, 16), 128 GPUs", "recomputation is needed at larger batches",
                     "no recompute fits at every batch up to 128", False))
    r = plan(["model=gpt_145.6b"], 128, 256, 8, 16, True, 1, ("1f1b",))
    rows.append(("Fig. 4.17, 145.6B (8, 16), 128 GPUs", "with recomputation large batches run", f"batch 256: {verdict(r)}",
                 fits(r)))
    for t, p in ((1, 2), (2, 1)):
        r = plan(GPT_5_9B, 64, 512, t, p, True, 1)
        rows.append(("Figs. 4.14/4.15, 5.9B", f"fits with model-parallel size 2: (t, p) = ({t}, {p}), b=1",
                     verdict(r), fits(r)))
    for t, p in ((2, 32), (4, 16), (8, 8), (16, 4), (32, 2)):
        r = plan(GPT_162B, 64, 128, t, p, True)
        rows.append(("Fig. 4.13, 162.2B, 64 GPUs", f"(t, p) = ({t}, {p}) ran (batch 128)", verdict(r), fits(r)))
    for p in (1, 2, 4, 8):
        model = ["model=gpt_1.7b", f"model.num_layers={3 * p}", "model.hidden_size=20480", "model.num_heads=128"]
        r = plan(model, 8 * p, 128, 8, p, True, 1, ("1f1b",))
        rows.append(("Fig. 4.11, weak scaling", f"{3 * p} layers, h = 20480, (t, p) = (8, {p}), b=1, batch 128 ran",
                     verdict(r), fits(r)))
    for gpus in (384, 768, 1536):
        r = plan(["model=gpt3_175b"], gpus, 1536, 8, 12, True, 1)
        rows.append(("Table 4.2, 174.6B", f"model-parallel size 96 = (8, 12), {gpus} GPUs, batch 1536, b=1 ran",
                     verdict(r), fits(r)))
    for gpus in (560, 1120, 2240):
        r = plan(["model=gpt_529.6b"], gpus, 2240, 8, 35, True, 1)
        rows.append(("Table 4.2, 529.6B", f"model-parallel size 280 = (8, 35), {gpus} GPUs, batch 2240, b=1 ran",
                     verdict(r), fits(r)))
    return rows


def memory_section() -> str:
    lines = ["| where | the dissertation | the planner (pinned, DGX A100 80 GB) | agrees |", "|---|---|---|---|"]
    for where, claim, ours, ok in memory_rows():
        lines.append(f"| {where} | {claim} | {ours} | {'yes' if ok else '**no**'} |")
    lines += ["", "Not checked: Fig. 4.16 (the 91B model's dimensions are not given), Fig. 4.12 (GPT-3 on 96 GPUs: "
              "the (t, p) is not given), Table 4.2's ZeRO-3 rows (DeepSpeed's ZeRO-3 without pipelining; this "
              "planner takes ZeRO-3 only where ZeRO-1 does not fit), and ch. 3's V100 footprints (Figs. 3.7, 3.9, 3.11: the models' dimensions are "
              "not given in the text)."]
    return "\n".join(lines)


def per_gpu(result) -> str:
    best = result[0]
    return "no plan" if isinstance(best, str) else f"{best.tflops_per_device:.0f}"


def trends_section() -> str:
    """The qualitative trends of Figs. 4.11-4.17 and Table 4.2 with the planner's numbers."""
    out = []
    rows = []
    for batch in (32, 128, 512):
        cells = [per_gpu(plan(GPT_5_9B, 64, batch, 1, p, True, 1)) for p in (2, 4, 8, 16, 32)]
        rows.append(f"| Fig. 4.14 (5.9B, t=1, b=1), batch {batch} | p = 2, 4, 8, 16, 32 | {', '.join(cells)} |")
    for batch in (32, 128, 512):
        cells = [per_gpu(plan(GPT_5_9B, 64, batch, t, 1, True, 1)) for t in (2, 4, 8, 16, 32)]
        rows.append(f"| Fig. 4.15 (5.9B, p=1, b=1), batch {batch} | t = 2, 4, 8, 16, 32 | {', '.join(cells)} |")
    for batch in (8, 128):
        cells = []
        for p in (1, 2, 4, 8):
            model = ["model=gpt_1.7b", f"model.num_layers={3 * p}", "model.hidden_size=20480", "model.num_heads=128"]
            cells.append(per_gpu(plan(model, 8 * p, batch, 8, p, True, 1, ("1f1b",))))
        rows.append(f"| Fig. 4.11 (weak scaling, t=8, b=1), batch {batch} | p = 1, 2, 4, 8 | {', '.join(cells)} |")
    cells = [per_gpu(plan(GPT_162B, 64, 128, t, 64 // t, True)) for t in (2, 4, 8, 16, 32)]
    rows.append(f"| Fig. 4.13 (162.2B, 64 GPUs), batch 128 | t = 2, 4, 8, 16, 32 (p = 64 / t) | {', '.join(cells)} |")
    for label, model, mp, batch in (("174.6B", ["model=gpt3_175b"], (8, 12), 1536),
                                    ("529.6B", ["model=gpt_529.6b"], (8, 35), 2240)):
        gpus = (384, 768, 1536) if label == "174.6B" else (560, 1120, 2240)
        for schedules in (None, ("1f1b",)):
            cells = [per_gpu(plan(model, n, batch, *mp, True, 1, schedules)) for n in gpus]
            how = "any schedule" if schedules is None else "1F1B only"
            rows.append(f"| Table 4.2, PTD-P {label}, batch {batch}, {how} | {', '.join(map(str, gpus))} GPUs | "
                        f"{', '.join(cells)} |")
    for batch in (8, 32, 128):
        cells = [per_gpu(plan(["model=gpt_145.6b"], 128, batch, 8, 16, rec, None, ("1f1b",))) for rec in (False, True)]
        rows.append(f"| Fig. 4.17 (145.6B, (8, 16)), batch {batch} | no recompute, recompute | {', '.join(cells)} |")
    out += ["| figure | varied | planner's hardware TFLOP/s per GPU |", "|---|---|---|"] + rows
    return "\n".join(out)


if __name__ == "__main__":
    print(memory_section())
    print()
    print(trends_section())
