"""Regenerates the generated sections of docs/planner.md: example dry runs (real output; the MoE
presets among them) and the comparison of the PTD-P search's (t, p) with Table 4.1's on the DGX-A100 preset.
Run: .venv/bin/python -m scripts.docs.planner
"""
from __future__ import annotations

import contextlib
import io
import re
import sys
from dataclasses import replace

from planner.__main__ import main as planner_main
from planner.config import compose, inputs_from_config
from planner.errors import DoesNotFitError, PlannerError
from planner.search.auto import make_plan
from planner.search.ptdp import ptdp_search
from planner.search.ranking import GIB, why_lost
from scripts import ROOT
from scripts.docs.planner_claims import memory_section, trends_section
from scripts.docs.planner_paper_tables import paper_tables_section

DOC = ROOT / "docs" / "planner.md"
# Table 4.1 (dissertation ch. 4.5.1): preset, GPUs, batch, t, p, achieved TFLOP/s per GPU
TABLE_4_1 = [("gpt_1.7b", 32, 512, 1, 1, 137), ("gpt_3.6b", 64, 512, 2, 1, 138), ("gpt_7.5b", 128, 512, 4, 1, 142),
             ("gpt_18.4b", 256, 1024, 8, 1, 135), ("gpt_39.1b", 512, 1536, 8, 2, 138),
             ("gpt_76.1b", 1024, 1792, 8, 4, 140), ("gpt_145.6b", 1536, 2304, 8, 8, 148),
             ("gpt_310.1b", 1920, 2160, 8, 16, 155), ("gpt_529.6b", 2520, 2520, 8, 35, 163),
             ("gpt_1t", 3072, 3072, 8, 64, 163)]
DRY_RUN = ["model=gpt3_175b", "cluster=dgx_a100", "cluster.nodes=12", "train.global_batch_size=1536",
           "planner.out=plan.json"]
LONG_CONTEXT = ["model=llama3_405b", "model.seq_len=131072", "cluster=h100_x8", "cluster.nodes=16",
                "train.global_batch_size=64", "planner.out=plan.json"]
MOE_RUNS = (["model=mixtral_8x7b", "cluster=h100_x8", "cluster.nodes=2", "planner.out=plan.json"],
            ["model=qwen2_moe_a2.7b", "cluster=h100_x8", "cluster.nodes=1", "planner.out=plan.json"])


def dry_run_section(argv: list[str] = DRY_RUN) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = planner_main([a.replace("planner.out=plan.json", "planner.out=/tmp/planner_docs_plan.json")
                             for a in argv])
    assert code == 0
    text = buf.getvalue().replace("/tmp/planner_docs_plan.json", "plan.json")
    return f"```\n$ python -m planner {' '.join(argv)}\n{text.rstrip()}\n```"


def long_context_section() -> str:
    """The 405B / 128K plan on 16 nodes, and the best plan without context parallelism (in a line)."""
    base = [a for a in LONG_CONTEXT if not a.startswith("planner.out=")]
    without = base + ["planner.context_parallel=false"]
    try:
        best = make_plan(inputs_from_config(compose(without)), simulate=False).result.best
        with_cp = make_plan(inputs_from_config(compose(base)), simulate=False).result.best
        alone = (f"Without context parallelism (`planner.context_parallel=false`) the best is pp={best.pp} "
                 f"tp={best.tp} dp={best.dp} at {best.iteration_time:.4g} s per iteration, "
                 f"{best.iteration_time / with_cp.iteration_time:.2g} x the plan above.")
    except DoesNotFitError as err:
        alone = (f"Without context parallelism (`planner.context_parallel=false`) nothing fits: "
                 f"{_closest(err.smallest)}")
    except PlannerError as err:
        alone = f"Without context parallelism: {err}"
    return f"{dry_run_section(LONG_CONTEXT)}\n\n{alone.rstrip()}"


def _closest(c) -> str:
    """What the configuration closest to fitting holds per rank, as a sentence (empty if unknown)."""
    if c is None or not c.memory_parts:
        return ""
    parts = ", ".join(f"{name} {c.memory_parts[key] / GIB:.2f}" for key, name in (
        ("weights", "weights"), ("gradients", "gradients"), ("optimizer", "optimizer state"),
        ("activations", "activations")))
    zero = (f"ZeRO-{c.zero}" + (" with `optim.reshard_after_forward` (fully sharded)" if c.reshard_after_forward else "")
            if c.zero > 1 else f"ZeRO-{c.zero}")
    return (f"the closest, pp={c.pp} tp={c.tp} cp={c.cp} dp={c.dp} vpp={c.vpp} at {zero}, holds per rank {parts} GiB: "
            f"{c.memory_bytes / GIB:.1f} GiB with the reserve, over the {c.capacity_bytes / GIB:.1f} GiB of a device.")


def moe_section() -> str:
    """The two MoE example plans, each as its dry run prints it."""
    return "\n\n".join(dry_run_section(argv) for argv in MOE_RUNS)


def _config(c) -> str:
    v = f", v={c.vpp}" if c.vpp > 1 else ""
    return f"t={c.tp} p={c.pp} d={c.dp}{v} b={c.micro} {c.schedule}{', recompute' if c.recompute else ''}"


def table_section() -> str:
    rows = ["| model | GPUs | batch | paper (t, p) | paper TFLOP/s | planner's choice | predicted TFLOP/s | "
            "paper's (t, p) in our model | why they differ |", "|---|---|---|---|---|---|---|---|---|"]
    for preset, gpus, batch, t, p, tflops in TABLE_4_1:
        cfg = compose([f"model={preset}", "cluster=dgx_a100", f"cluster.nodes={gpus // 8}",
                       f"train.global_batch_size={batch}"])
        inputs = inputs_from_config(cfg).as_in_the_dissertation()
        ours = ptdp_search(inputs).best
        try:
            theirs = ptdp_search(replace(inputs, pin_tp=t, pin_pp=p, recompute=(True,))).best
            theirs_cell = f"{theirs.tflops_per_device:.0f} TFLOP/s ({_config(theirs)})"
        except PlannerError as err:
            theirs, theirs_cell = None, "does not fit"
            need = re.search(r"needs ([\d.]+) GiB", str(err))
            reason = (f"the paper's (t, p) needs {need.group(1)} GiB per device in our memory model "
                      f"(> {inputs.capacity / GIB:.0f} GiB); the paper's implementation kept less"
                      if need else str(err))
        if (ours.tp, ours.pp) == (t, p):
            reason = "same (t, p)"
            if theirs is not None and theirs.key != ours.key:
                reason += f"; the same best configuration differs only in {_config(ours)}"
        elif theirs is not None:
            reason = f"paper's (t, p) is {why_lost(theirs, ours)}"
            if not ours.recompute:
                reason += "; the paper always recomputes activations, we recompute only when memory needs it"
        rows.append(f"| {preset} | {gpus} | {batch} | ({t}, {p}) | {tflops} | {_config(ours)} | "
                    f"{ours.tflops_per_device:.0f} | {theirs_cell} | {reason} |")
    rows += ["", "TFLOP/s are hardware FLOPs, the passes the devices run: eq. 4.2's 4 with recomputation (as "
             "Table 4.1 counts them; the paper recomputed in every row), 3 for a plan that recomputes nothing "
             "(a 4th pass it never runs would be claimed work, above the device's peak for a plan near it). The "
             "paper's (t, p) is pinned with recomputation, as the paper ran it."]
    return "\n".join(rows)


def replace_section(text: str, name: str, body: str) -> str:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in text:
        raise SystemExit(f"docs/planner.md has no {start} marker")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def main() -> int:
    text = DOC.read_text()
    text = replace_section(text, "dry-run", dry_run_section())
    text = replace_section(text, "long-context", long_context_section())
    text = replace_section(text, "moe", moe_section())
    text = replace_section(text, "table41", table_section())
    text = replace_section(text, "memory-claims", memory_section())
    text = replace_section(text, "trends", trends_section())
    text = replace_section(text, "paper-tables", paper_tables_section())
    DOC.write_text(text)
    print(f"updated {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
