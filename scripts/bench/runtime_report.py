"""Statistics and the Markdown section of scripts/bench/runtime.py (kept apart from the runners so
each file stays small). Every sentence with a number is generated from the measured JSON."""
from __future__ import annotations

import json
import os
import platform
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipedream.schedules import schedule_info


@dataclass
class Stat:
    median: float
    min: float
    max: float

    @staticmethod
    def of(values: list[float]) -> "Stat":
        return Stat(statistics.median(values), min(values), max(values))


SINGLE = "single-process"
BOTH_CORES = "single-process [both cores]"   # a copy of the single process on each core at once


def ideal_bubble(schedule: str, m: int, pp: int) -> float:
    """The idle share of an iteration with equal stages and free communication, from the schedule's
    ``ScheduleInfo.bubble`` (idle over compute; (p-1)/(v m + p-1) of the iteration for the 1F1B
    family, interleaved at v = 2); none for the asynchronous schedules in steady state (their fill
    and drain happen once a run). Torch's two-chunk zero-bubble schedule is counted as zbv."""
    info = schedule_info("zbv" if schedule == "interleaved_zb" else schedule)
    relative = float(info.bubble(pp, m, 2 if info.interleaves else 1))
    return relative / (1 + relative)


def analyse(times: dict[str, list[float]], global_batch: int, microbatches: int, pp: int) -> dict[str, Any]:
    """Per case: step time stats, throughput; pipelines also their ratios, taken repeat by repeat."""
    single, both = times[SINGLE], times.get(BOTH_CORES)
    rows: dict[str, Any] = {}
    for name, values in times.items():
        row: dict[str, Any] = {"step_time_s": asdict(Stat.of(values)),
                               "samples_per_s": global_batch / statistics.median(values), "times_s": values}
        if name == BOTH_CORES:
            row["speedup_vs_single"] = asdict(Stat.of([s / t for s, t in zip(single, values)]))
        elif name != SINGLE:
            runtime, schedule = name.split(" [")[0].split(" ", 1)
            bubble = ideal_bubble(schedule, microbatches, pp)
            ideal = [s / (pp * (1 - bubble)) for s in single]
            row.update(ideal_step_time_s=statistics.median(ideal), ideal_bubble=bubble,
                       of_ideal=asdict(Stat.of([i / t for i, t in zip(ideal, values)])),
                       speedup_vs_single=asdict(Stat.of([s / t for s, t in zip(single, values)])))
            if both:   # the same ideal from the single process's speed while both cores work
                row["of_ideal_both_cores"] = asdict(Stat.of([s / (pp * (1 - bubble)) / t
                                                             for s, t in zip(both, values)]))
            if runtime == "pipedream" and f"torch {schedule}" in times:
                theirs = times[f"torch {schedule}"]
                row["vs_torch"] = asdict(Stat.of([t / o for t, o in zip(theirs, values)]))   # throughput ratio
        rows[name] = row
    return rows


def machine() -> dict[str, Any]:
    import torch

    from pipedream.observe.peak_flops import cpu_model

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "os": f"{platform.system()} {platform.release()}"}


def _fmt_ms(stat: dict[str, float]) -> str:
    return f"{stat['median'] * 1e3:.1f} ({stat['min'] * 1e3:.1f}-{stat['max'] * 1e3:.1f})"


def _fmt_ratio(stat: dict[str, float] | None, percent: bool = False) -> str:
    if stat is None:
        return ""
    if percent:
        return f"{stat['median']:.0%} ({stat['min']:.0%}-{stat['max']:.0%})"
    return f"{stat['median']:.2f}x ({stat['min']:.2f}-{stat['max']:.2f})"


def trace_notes(workload: dict[str, Any], pp: int, img: str | None) -> list[str]:
    """What the traced iteration of our 1f1b shows: compute per micro-batch in the pipeline
    against the single process, imbalance, and the simulator's prediction from those durations."""
    traced = workload.get("traced") or {}
    r = traced.get("report")
    if not r:
        return []
    m = workload["microbatches"]
    solo = workload["cases"]["single-process"]["step_time_s"]["median"] / (m * pp)   # one stage, one micro-batch
    per_stage = {k.split(".")[0]: r["forward_s"][k] + r["backward_s"][k] for k in r["forward_s"]}
    slowest = max(per_stage.values())
    extra = r["iteration_time_s"] - r["predicted_iteration_time_s"]
    gap = (f"the measured iteration is {extra * 1e3:.1f} ms longer: message latency and waits for the CPU, "
           "which the simulator does not model" if extra > 0 else
           "the measured iteration is no longer: communication is hidden")
    lines = [
        f"Traced iteration of our 1f1b (after warm-up): {r['iteration_time_s'] * 1e3:.1f} ms. Forward + backward "
        "of one micro-batch per stage: " + ", ".join(f"stage {k} {v * 1e3:.1f} ms" for k, v in per_stage.items())
        + f", against {solo * 1e3:.1f} ms for half the model in the single process (its step time / (m p)): "
        f"the slowest stage takes {slowest / solo:.2f}x the single process's time while both processes work "
        f"(the cores share caches and memory bandwidth, and any other load on the machine; "
        f"other processes took {traced.get('other_load', 0.0):.0%} of the CPU during the traced iterations).",
        f"The simulator fed with these measured durations predicts {r['predicted_iteration_time_s'] * 1e3:.1f} ms "
        f"for the iteration ({gap})."
        f" Measured idle share per rank (time not in forward/backward compute): "
        + ", ".join(f"{b:.1%}" for b in r["bubble_fraction_per_rank"])
        + f"; ideal {r['ideal_bubble_fraction']:.1%}. With plain 1f1b the slowest stage sets the pace: "
        f"(m + p - 1) x its forward + backward = {(m + pp - 1) * slowest * 1e3:.1f} ms before the optimizer step; "
        f"weight-gradient GEMMs run after the send and held back (W boxes) take part of the fill and drain "
        f"off that path.",
    ]
    if img:
        lines += ["", f"![measured timeline]({img}/timeline.png)", "",
                  f"![predicted timeline]({img}/timeline_predicted.png)"]
    return lines


def limits(data: dict[str, Any]) -> list[str]:
    """Generated explanation for unmet targets, from the numbers and trace of each workload that
    has one (a target names its workload: "(MLP", "(GPT")."""
    unmet = [t["name"] for t in data["targets"] if not t["met"]]
    lines: list[str] = []
    for name, w in data["workloads"].items():
        if any(f"({name.upper()}" in target for target in unmet) and "vs_torch" in w["cases"].get("pipedream 1f1b", {}):
            lines += _workload_limits(name.upper(), w, data["settings"]["pp"])
    return lines


def _workload_limits(label: str, w: dict[str, Any], pp: int) -> list[str]:
    """Our 1f1b on one workload: its ratio to torch's, against the ideal, and its traced iteration."""
    ours = w["cases"]["pipedream 1f1b"]
    lines = [f"What limits it ({label}): the per-round ratio of our 1f1b's throughput to torch's has median "
             f"{ours['vs_torch']['median']:.2f}x (range {ours['vs_torch']['min']:.2f}-{ours['vs_torch']['max']:.2f}), "
             f"and our step is {ours['of_ideal']['median']:.0%} of the ideal (range {ours['of_ideal']['min']:.0%}-"
             f"{ours['of_ideal']['max']:.0%})."]
    if "of_ideal_both_cores" in ours:
        lines.append("The ideal takes each core to compute as fast as the single process alone; the "
                     f"*[both cores]* line under the {label} table measures how far this machine's cores fall short "
                     "of that while both work, and our 1f1b against the ideal rebuilt from that speed.")
    r = (w.get("traced") or {}).get("report")
    if r:
        solo = w["cases"]["single-process"]["step_time_s"]["median"] / (w["microbatches"] * pp)
        slowest = max(r["forward_s"][k] + r["backward_s"][k] for k in r["forward_s"])
        on_path = r["iteration_time_s"] <= 1.1 * r["predicted_iteration_time_s"]
        ideal = ours["ideal_step_time_s"]
        lines.append(f"The traced "
                     f"iteration, taken while other processes used {w['traced'].get('other_load') or 0.0:.0%} of the CPU, took {r['iteration_time_s'] * 1e3:.1f} ms: "
                     f"{ideal / r['iteration_time_s']:.0%} of the ideal {ideal * 1e3:.1f} ms.")
        lines.append(f"The ideal assumes each stage computes a micro-batch as fast as the single process does "
                     f"({solo * 1e3:.1f} ms per half model); in the traced pipeline iteration the slowest stage "
                     f"takes {slowest * 1e3:.1f} ms ({slowest / solo:.2f}x), and the simulator fed with the "
                     f"measured durations predicts {r['predicted_iteration_time_s'] * 1e3:.1f} ms against "
                     f"{r['iteration_time_s'] * 1e3:.1f} ms measured"
                     + (": the schedule runs at its critical path, and what is lost against the ideal is "
                        "per-stage compute speed while both cores work (shared caches and memory bandwidth, "
                        "other processes on this machine), the unequal stages and the optimizer step at the "
                        "flush." if on_path else
                        ": the rest is communication latency and waiting for the CPU, on top of slower "
                        "per-stage compute while both cores work."))
        lines.append(ceiling_note(w, slowest))
    return lines


def ceiling_note(w: dict[str, Any], slowest: float) -> str:
    """The fastest any runtime could step with these stages' compute: the slowest stage running its
    m micro-batches back to back, against torch's 1f1b."""
    m = w["microbatches"]
    theirs = w["cases"].get("torch 1f1b", {}).get("step_time_s", {}).get("median")
    if not theirs:
        return ""
    bound = m * slowest
    return (f"A ceiling for any schedule on this split: the slowest stage computing its {m} micro-batches back to "
            f"back, with no bubble, no message and no optimizer step, takes {bound * 1e3:.1f} ms, so a step "
            f"at most {theirs / bound:.2f}x faster than torch's 1f1b ({theirs * 1e3:.1f} ms). It bounds gpipe and 1f1b; "
            f"the two-chunk schedules' ranks hold as many blocks each. Past that, only faster per-layer compute "
            f"(the same kernels in both runtimes) would raise the ratio.")


def gains(workload: dict[str, Any]) -> list[str]:
    """Where our 1f1b's lead over torch's comes from, from the variant rows of one workload."""
    cases = workload["cases"]
    rows = [("our runtime with plain autograd", "pipedream 1f1b [plain autograd]"),
            ("with weight gradients accumulated inside the GEMM", "pipedream 1f1b [no send-first]"),
            ("with each backward sending its input gradient before its weight-gradient GEMMs",
             "pipedream 1f1b [no delay]"),
            ("and those GEMMs held back until the next backward's send", "pipedream 1f1b")]
    if not all(name in cases and "vs_torch" in cases[name] for _, name in rows):
        return []
    parts = [f"{label} {cases[name]['vs_torch']['median']:.2f}x" for label, name in rows]
    return ["Where our 1f1b's lead over torch's Schedule1F1B comes from (throughput ratios, median per round): "
            + "; ".join(parts) + "."]


def both_cores(workload: dict[str, Any]) -> list[str]:
    """How fast one core computes while the other works too, and our 1f1b against that ideal."""
    cases = workload["cases"]
    if BOTH_CORES not in cases or "of_ideal_both_cores" not in cases.get("pipedream 1f1b", {}):
        return []
    speed, ours = cases[BOTH_CORES]["speedup_vs_single"], cases["pipedream 1f1b"]["of_ideal_both_cores"]
    return [f"One core's speed while the other core works too (row *[both cores]*: a copy of the single "
            f"process on each core at once): {speed['median']:.2f}x its speed alone (range {speed['min']:.2f}-"
            f"{speed['max']:.2f}). The ideal assumes 1.00x. Against the ideal built from the single process's "
            f"time while both cores work, our 1f1b reaches {ours['median']:.0%} (range {ours['min']:.0%}-"
            f"{ours['max']:.0%})."]


def global_check(workload: dict[str, Any]) -> list[str]:
    """What the gradient norm over every rank before the update costs (the rows *[global check]*):
    the most that post-validation, which steps first and checks afterwards, could save."""
    cases = workload["cases"]
    parts = []
    for name in cases:
        plain = name.split(" [")[0]
        if name.endswith("[global check]") and plain in cases:
            ratio = statistics.median(c / p for c, p in zip(cases[name]["times_s"], cases[plain]["times_s"]))
            parts.append(f"{plain.split(' ', 1)[1]} {ratio:.3f}x")
    if not parts:
        return []
    return ["The global check before the optimizer step (rows *[global check]*: `train.grad_clip=1e9`, the "
            "gradient norm all-reduced over every rank, a bound no gradient reaches) costs, as step time with it / "
            "without it per round (median): " + ", ".join(parts) + ". Post-validation (step first, undo when "
            "the check fails) could save at most that."]


def rows_note(cases: set[str]) -> str:
    """What the rows beyond the plain schedules are: only those among ``cases`` (a run with
    ``--targets-only`` leaves out the variants and the asynchronous schedules)."""
    text = ""
    if any(name.endswith(("[plain autograd]", "[no send-first]", "[no delay]")) for name in cases):
        text += (" Rows *[plain autograd]*, *[no send-first]* and *[no delay]* are our 1f1b with its runtime "
                 "optimisations turned off: all (`train.fuse_grad_accumulation=false "
                 "train.weight_grads_after_send=false`), the send-first split (`train.weight_grads_after_send=false`), "
                 "and only the holding back of weight gradients behind the next backward's send "
                 "(`train.weight_grads_delay=0`).")
    if any(name.endswith("[no graph split]") for name in cases):
        text += (" Rows *[no graph split]* are our zero-bubble schedules on the stock modules with "
                 "`train.split_weight_graphs=false`: W holds only the fused Linear GEMMs, and the other weight "
                 "gradients (attention projections, norms) are computed in B.")
    if BOTH_CORES in cases:
        text += (" Row *single-process [both cores]* runs a copy of the single process on each core at the same "
                 "time (rank 0's time): one core's speed while both work.")
    if any(name.split(" [")[0] in ("pipedream 2bw", "pipedream pipedream") for name in cases):
        text += (" The asynchronous schedules (*2bw*, *pipedream*: no flush; torch has no counterpart) are ours "
                 "only; their ideal assumes no bubble. A *pipedream* step is m optimizer updates (one per "
                 "micro-batch), a *2bw* step one.")
    if any(name.split(" [")[0].split(" ")[-1] in ("zb_h2", "zbv", "interleaved_zb", "dualpipev") for name in cases):
        text += (" Zero-bubble rows: ours *zb_h2* and *zbv* (W actions), torch's `ScheduleZBVZeroBubble` "
                 "(*torch zbv*), `ScheduleInterleavedZeroBubble` (*torch interleaved_zb*, two chunks per rank) "
                 "and `ScheduleDualPipeV` (*dualpipev*, ours and torch's), on the same blocks and batch; their "
                 "ideal bubble is the zero-bubble order's flushed iteration at F = B = W per chunk "
                 "(each schedule's `ScheduleInfo.bubble`, pipedream/schedules/; torch's interleaved_zb counted as zbv).")
    return text


def _binding_note(core_sets: list | None) -> str:
    """How the processes sat on the cores: ours, torch's and the single process run in the same
    processes, so whatever the binding, each runtime had the same."""
    if core_sets:
        shown = "; ".join(f"process {rank} on core{'s' if len(cores) > 1 else ''} {','.join(map(str, cores))}"
                          for rank, cores in enumerate(core_sets))
        return (f"Each process is pinned to its own cores ({shown}; `os.sched_setaffinity`, as "
                f"`launcher.bind_cores=auto` pins the ranks), and every runtime, ours, torch's and the single "
                f"process, runs in those same processes: the same binding for all.")
    return ("The processes are not pinned to cores (`--bind-cores none`); every runtime, ours, torch's and the "
            "single process, runs in the same processes: the same placement for all.")


def split_line(workload: dict) -> str:
    """The layers per stage both runtimes ran (the runtime's default split), where recorded."""
    splits = workload.get("layers_per_stage")
    if not splits:
        return ""
    return (" Layers per stage (the default split, equal estimated cost; torch's schedules get the same): "
            + "; ".join(f"{where} {counts}" for where, counts in splits.items()) + ".")


def markdown(data: dict[str, Any], images: dict[str, str]) -> str:
    m, s = data["machine"], data["settings"]
    load = data.get("other_load")
    load_text = (f" Other processes used {load:.0%} of the machine's CPU while it ran (a shared machine: "
                 f"their load slows some runs, which the min-max ranges show)." if load is not None else "")
    out = ["## Runtime: our pipeline vs torch.distributed.pipelining vs one process", "",
           f"Measured {data['date']} on {m['cpu']} ({m['cores']} cores), torch {m['torch']}, Python {m['python']}, "
           f"{m['os']}, in {data['duration_s']:.0f} s. Generated by `{data['command']}`; do not edit by hand."
           + load_text, "",
           f"{s['pp']} pipeline stages ({s['pp']} processes, Gloo, 1 thread each) against the same model in one "
           f"process (1 thread) with the same micro-batches and gradient accumulation; the same optimizer "
           f"(this repository's SGD config, no clipping) everywhere. " + _binding_note(s.get("core_sets")) + " "
           f"Every case is built once and run "
           f"{s['warmup']} untimed iterations; then {s['rounds']} rounds run every case for {s['block']} timed "
           f"iterations, one case after the other (torch's 1f1b, ours and the single process first, back to back; "
           f"the order reversed every other round); before a round the "
           f"benchmark waits for other processes to use less than {s.get('max_other_load', 1):.0%} of the CPU "
           f"(at most {s.get('wait_budget_s', 0):.0f} s in all). Step time: median (min-max) over rounds. Ratios "
           f"are taken within each round, then median (min-max). *vs torch*: our throughput / torch's on "
           f"the same schedule. *Ideal*: single-process time / (p (1 - bubble)), bubble = (p-1)/(v m + p-1)."
           + rows_note({name for w in data["workloads"].values() for name in w["cases"]}), ""]
    for name, w in data["workloads"].items():
        loads = [v for values in w.get("other_load_per_run", {}).values() for v in values]
        load_line = (f" Other processes' share of the CPU during the timed runs: median "
                     f"{statistics.median(loads):.0%}, max {max(loads):.0%}." if loads else "")
        out += [f"### {w['description']}", "",
                f"Global batch {w['global_batch']} = {w['microbatches']} micro-batches of {w['micro_batch']}."
                + split_line(w) + load_line, "",
                "| runtime | step time ms | samples/s | vs torch | speedup vs 1 process | ideal ms | of ideal |",
                "|---|---|---|---|---|---|---|"]
        for case_name, row in w["cases"].items():
            ideal = f"{row['ideal_step_time_s'] * 1e3:.1f}" if "ideal_step_time_s" in row else ""
            out.append(f"| {case_name} | {_fmt_ms(row['step_time_s'])} | {row['samples_per_s']:.1f} | "
                       f"{_fmt_ratio(row.get('vs_torch'))} | {_fmt_ratio(row.get('speedup_vs_single'))} | {ideal} | "
                       f"{_fmt_ratio(row.get('of_ideal'), percent=True)} |")
        out.append("")
        lead = gains(w) + both_cores(w) + global_check(w)
        out += lead + ([""] if lead else [])
        notes = trace_notes(w, s["pp"], images.get(name))
        out += notes + ([""] if notes else [])
    out += ["### Targets", ""]
    for t in data["targets"]:
        value = f"{t['value']:.2f}x" if t["format"] == "ratio" else f"{t['value']:.1%}"
        out.append(f"- {t['name']}: measured {value}, **{'met' if t['met'] else 'not met'}**.")
    out.append("")
    explanation = limits(data)
    out += explanation + ([""] if explanation else [])
    return "\n".join(out)


def replace_section(path: Path, name: str, body: str) -> None:
    """Rewrites only this script's section of a shared Markdown file (other scripts own theirs)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    text = path.read_text(encoding="utf-8") if path.exists() else (
        "# Benchmarks\n\nEach section is written by the script it names, between its `<!-- name:begin/end -->` "
        "markers; rerun the script to refresh its section.\n")
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def write_report(out: Path, report: dict, text: str, section: str) -> None:
    """``out``.json (the raw numbers), ``out``.md, and this script's section of docs/benchmarks.md."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(text)
    replace_section(out.parent / "benchmarks.md", section, text)
    print(text)
