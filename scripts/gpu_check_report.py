"""The report of scripts/gpu_check.sh.

    gpu_check_report.py facts                       # device facts as one JSON line (step 1)
    gpu_check_report.py record --manifest M ...     # append one step's outcome to the manifest
    gpu_check_report.py write --manifest M --work W --out DIR [--dry-run]

`write` reads every step's outcome, the gpu tests' JUnit XML and each training run's summary.json,
and writes DIR/gpu_check.json, DIR/gpu_check.md and DIR/gpu_check.log (every step's output). Every
figure comes from a run's own output; MFU is also given against the GPU's dense bf16 peak."""
from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

TAIL_CHARS = 3000
LOG_CHARS = 200_000   # per step in gpu_check.log


def dense_bf16_peak(gpu_name: str | None) -> float | None:
    """The GPU's dense bf16 peak FLOP/s from the project's device sheets (None without one)."""
    from pipedream.devices import DEVICES
    from pipedream.observe.peak_flops import gpu_sheet

    sheet = gpu_sheet(gpu_name or "")
    return None if sheet is None else DEVICES[sheet].flops("bf16")


def tail(path: str | None, chars: int = TAIL_CHARS) -> str:
    if not path or not Path(path).exists():
        return ""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    return text[-chars:]


# ---------------------------------------------------------------------------------------- facts
def facts() -> int:
    import torch
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda_runtime": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    try:
        out["cudnn"] = torch.backends.cudnn.version()
    except Exception as error:  # noqa: BLE001 - a fact we could not read is recorded, not fatal
        out["cudnn"] = f"unavailable: {error}"
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as error:  # noqa: BLE001
        out["nccl"] = f"unavailable: {error}"
    try:
        shm = shutil.disk_usage("/dev/shm")
        out["dev_shm"] = f"{shm.total / 2**30:.1f} GiB, {shm.free / 2**30:.1f} GiB free"
    except OSError as error:
        out["dev_shm"] = f"unavailable: {error}"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as error:
        out["nvidia_smi"] = f"unavailable: {error}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(device_count=torch.cuda.device_count(), gpu_name=props.name,
                   gpu_memory_bytes=props.total_memory, multiprocessors=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}",
                   tf32_matmul_allowed=bool(torch.backends.cuda.matmul.allow_tf32))
        # an 8192^3 bf16 matmul: what the card reaches on one large GEMM (context for the MFU figures)
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        start, reps = time.perf_counter(), 20
        for _ in range(reps):
            a @ b
        torch.cuda.synchronize()
        out["bf16_matmul_8192_tflops"] = 2 * n**3 * reps / (time.perf_counter() - start) / 1e12
    print(json.dumps(out))
    return 0


# ---------------------------------------------------------------------------------------- record
def record(args: argparse.Namespace) -> int:
    entry = {"name": args.name, "kind": args.kind, "status": args.status, "rc": args.rc,
             "seconds": args.seconds, "timeout_s": args.timeout,
             "run_dir": None if args.run_dir in (None, "-") else args.run_dir,
             "stdout": args.stdout, "stderr": args.stderr, "command": shlex.join(args.command)}
    with open(args.manifest, "a", encoding="utf-8") as manifest:
        manifest.write(json.dumps(entry) + "\n")
    return 0


# ---------------------------------------------------------------------------------------- write
def parse_facts(entry: dict) -> dict | None:
    for line in reversed(tail(entry.get("stdout"), 100_000).splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def parse_pytest(entry: dict, xml_path: Path) -> dict:
    result: dict[str, Any] = {"source": None, "tests": []}
    if xml_path.exists():
        try:
            root = ET.parse(xml_path).getroot()
            for case in root.iter("testcase"):
                outcome, text = "passed", ""
                for tag in ("failure", "error", "skipped"):
                    node = case.find(tag)
                    if node is not None:
                        outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                        text = ((node.get("message") or "") + "\n" + (node.text or "")).strip()
                        break
                result["tests"].append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                                        "seconds": float(case.get("time") or 0), "text": text[-TAIL_CHARS:]})
            result["source"] = "junit"
        except ET.ParseError as error:
            result["xml_error"] = str(error)
    if not result["tests"]:   # killed before the XML was written: the -v lines
        for line in tail(entry.get("stdout"), 1_000_000).splitlines():
            for word, outcome in ((" PASSED", "passed"), (" FAILED", "failed"), (" ERROR", "error"),
                                  (" SKIPPED", "skipped")):
                if "::" in line and word in line and not line.startswith(("PASSED", "FAILED", "ERROR", "SKIPPED")):
                    result["tests"].append({"test": line.split(word)[0].strip(), "outcome": outcome, "text": ""})
                    break
        result["source"] = "stdout" if result["tests"] else None
    counts = {k: 0 for k in ("passed", "failed", "error", "skipped")}
    for test in result["tests"]:
        counts[test["outcome"]] += 1
    result["counts"] = counts
    return result


def parse_summary(entry: dict, gpu_name: str | None) -> dict | None:
    run_dir = entry.get("run_dir")
    path = Path(run_dir) / "summary.json" if run_dir else None
    if path is None or not path.exists():
        return None
    s = json.loads(path.read_text(encoding="utf-8"))
    rank0 = (s.get("ranks") or [{}])[0]
    tflops = s.get("tflops_per_device")
    peak = dense_bf16_peak(gpu_name)
    out = {"steps": s.get("steps"), "schedule": s.get("schedule"), "precision": s.get("precision"),
           "batch": s.get("batch"), "median_step_time_s": s.get("median_step_time_s"),
           "samples_per_s": s.get("samples_per_s"), "tokens_per_s": s.get("tokens_per_s"),
           "tflops_per_device": tflops, "mfu_reported": s.get("mfu"),
           "peak_flops_reported": s.get("peak_flops_per_device"),
           "model_flops_per_iteration": s.get("model_flops_per_iteration"),
           "mfu_vs_dense_bf16_peak": (tflops * 1e12 / peak) if (tflops is not None and peak) else None,
           "dense_bf16_peak_flops": peak,
           "final_train_loss": s.get("final_train_loss"), "final_val_loss": s.get("final_val_loss"),
           "peak_memory_bytes": rank0.get("peak_memory_bytes"), "memory": rank0.get("memory")}
    if s.get("models") is not None:
        out["models"] = s["models"]
    if s.get("fused_stages") is not None:
        out["fused_stages"] = s["fused_stages"]
    metrics = Path(run_dir) / "metrics.jsonl"
    if metrics.exists():
        out["logged_steps"] = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines()
                               if line.strip()]
    return out


def fmt(value: Any, spec: str = ".3g", scale: float = 1.0, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    try:
        return f"{value * scale:{spec}}{unit}"
    except (TypeError, ValueError):
        return str(value)


def outcome_of(step: dict) -> str:
    if step["status"] == "dry_run":
        return "not run (dry run)"
    if step["status"] == "excluded":
        return "not run (not in GPU_CHECK_ONLY)"
    if step["status"] == "skipped":
        return "not run (the check's time budget was spent)"
    if step["rc"] == 0:
        if step["kind"] == "pytest" and step.get("pytest", {}).get("counts", {}).get("passed", 0) == 0:
            return "ran, no test passed"
        return "passed"
    if step["rc"] in (124, 137):
        return f"timed out ({step['timeout_s']} s)"
    return f"failed (exit {step['rc']})"


# (name, baseline step, step, what the ratio says); each row is written where both runs have a summary
COMPARISONS = (
    ("compiled layers (train.compile)", "train_bf16", "train_bf16_compile"),
    ("selective recomputation", "train_bf16", "train_bf16_selective"),
    ("4 fused models vs one model alone (x4 for training them one after another)", "single_model_bf16",
     "multi_model_4"),
    ("harmony_pp: bf16 vs fp32", "harmony_pp", "harmony_pp_bf16"),
)


def comparisons(steps: list[dict]) -> list[dict]:
    """Each pair's step-time and memory ratios, read from the two runs' summaries. For fused models,
    the speed-up over training the K models one after another is K x the single model's step time
    over the fused step time."""
    summaries = {s["name"]: s["summary"] for s in steps if s["kind"] == "train" and s.get("summary")}
    rows = []
    for what, base_name, name in COMPARISONS:
        base, run = summaries.get(base_name), summaries.get(name)
        if not base or not run or not base.get("median_step_time_s") or not run.get("median_step_time_s"):
            continue
        models = len(run["models"]) if isinstance(run.get("models"), list) else 1
        run_loss = run.get("final_train_loss")
        if models > 1 and all(m.get("final_train_loss") is not None for m in run["models"]):
            run_loss = sum(m["final_train_loss"] for m in run["models"]) / models   # the summary's is their sum
        base_mem = (base.get("peak_memory_bytes") or {}).get("allocated")
        run_mem = (run.get("peak_memory_bytes") or {}).get("allocated")
        rows.append({"what": what, "baseline": base_name, "run": name, "models": models,
                     "speedup": models * base["median_step_time_s"] / run["median_step_time_s"],
                     "peak_allocated_ratio": (run_mem / base_mem) if base_mem and run_mem else None,
                     "loss_difference": (run_loss - base["final_train_loss"])
                     if run_loss is not None and base.get("final_train_loss") is not None else None})
    return rows


def markdown(report: dict) -> str:
    lines = ["# GPU check", "", f"Written {report['written']}; "
             + ("dry run: nothing was run." if report["dry_run"] else f"device: {report['device_line']}."), ""]
    f = report.get("facts") or {}
    if f:
        lines += ["## Device", "", "| fact | value |", "| --- | --- |"]
        for key in ("gpu_name", "gpu_memory_bytes", "multiprocessors", "capability", "nvidia_smi", "torch",
                    "cuda_runtime", "nccl", "cudnn", "python", "dev_shm", "tf32_matmul_allowed", "bf16_matmul_8192_tflops"):
            if key in f:
                value = f[key]
                if key == "gpu_memory_bytes":
                    value = f"{value / 2**30:.1f} GiB"
                elif key == "bf16_matmul_8192_tflops":
                    value = f"{value:.0f} TFLOP/s"
                lines.append(f"| {key} | {value} |")
        lines.append("")
    lines += ["## Steps", "", "| step | outcome | seconds | command |", "| --- | --- | --- | --- |"]
    for step in report["steps"]:
        lines.append(f"| {step['name']} | {outcome_of(step)} | {fmt(step.get('seconds'), '.1f')} | "
                     f"`{step['command'].replace('|', '/')}` |")
    lines.append("")
    tests = [s for s in report["steps"] if s["kind"] == "pytest" and s["status"] == "ran"]
    for step in tests:
        p = step["pytest"]
        c = p["counts"]
        lines += ["## GPU tests", "", f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
                  f"{c['skipped']} skipped (from {p['source'] or 'nothing: no outcome could be read'}).", ""]
        if p["tests"]:
            lines += ["| test | outcome | seconds |", "| --- | --- | --- |"]
            lines += [f"| {t['test']} | {t['outcome']} | {fmt(t.get('seconds'), '.1f')} |" for t in p["tests"]]
            lines.append("")
        for t in p["tests"]:
            if t["outcome"] in ("failed", "error") and t["text"]:
                lines += [f"### {t['test']}", "", "```", t["text"][-TAIL_CHARS:], "```", ""]
            elif t["outcome"] == "skipped" and t["text"]:
                lines += [f"- skipped {t['test']}: {t['text'].splitlines()[0]}"]
        lines.append("")
    trains = [s for s in report["steps"] if s["kind"] == "train" and s.get("summary")]
    if trains:
        lines += ["## Training runs (pp=1, one GPU)", "",
                  "| run | precision | steps | batch (global = micro x m) | median step | tokens/s | TFLOP/s | "
                  "MFU (reported; its peak) | MFU vs dense bf16 peak | final loss | val loss | peak allocated | "
                  "peak reserved |", "| --- " * 13 + "|"]
        for step in trains:
            s = step["summary"]
            batch = s.get("batch") or {}
            shape = f"{batch.get('global', '-')} = {batch.get('micro', '-')} x {batch.get('num_microbatches', '-')}" \
                if batch else "-"
            peak = s.get("peak_flops_reported") or {}
            peak_text = f"{fmt(s.get('mfu_reported'), '.1f', 100, '%')} of {fmt(peak.get('flops'), '.0f', 1e-12)} TFLOP/s " \
                        f"({peak.get('precision', '?')})" if peak else fmt(s.get('mfu_reported'), '.1f', 100, '%')
            mem = s.get("peak_memory_bytes") or {}
            lines.append(f"| {step['name']} | {s.get('precision')} | {s.get('steps')} | {shape} | "
                         f"{fmt(s.get('median_step_time_s'), '.1f', 1e3, ' ms')} | {fmt(s.get('tokens_per_s'), ',.0f')} | "
                         f"{fmt(s.get('tflops_per_device'), '.1f')} | {peak_text} | "
                         f"{fmt(s.get('mfu_vs_dense_bf16_peak'), '.1f', 100, '%')} | {fmt(s.get('final_train_loss'), '.4f')} | "
                         f"{fmt(s.get('final_val_loss'), '.4f')} | {fmt(mem.get('allocated'), '.2f', 2**-30, ' GiB')} | "
                         f"{fmt(mem.get('reserved'), '.2f', 2**-30, ' GiB')} |")
        lines.append("")
        for step in trains:
            s = step["summary"]
            if s.get("memory"):
                lines += [f"- {step['name']} memory: `{json.dumps(s['memory'])[:1500]}`"]
            if s.get("models"):
                lines += [f"- {step['name']} models: `{json.dumps(s['models'])[:1500]}`"]
        lines.append("")
    if report.get("comparisons"):
        lines += ["## Comparisons", "", "*speed-up*: the baseline's step time over the run's (times the number of "
                  "fused models); *peak allocated*: the run's over the baseline's.", "",
                  "| what | baseline | run | speed-up | peak allocated | final loss, run - baseline (fused: their mean) |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for row in report["comparisons"]:
            lines.append(f"| {row['what']} | {row['baseline']} | {row['run']} | {fmt(row['speedup'], '.2f', unit='x')} | "
                         f"{fmt(row['peak_allocated_ratio'], '.2f', unit='x')} | {fmt(row['loss_difference'], '+.4f')} |")
        lines.append("")
    failed = [s for s in report["steps"] if s["status"] == "ran" and s["rc"] != 0]
    if failed:
        lines += ["## Failures", ""]
        for step in failed:
            lines += [f"### {step['name']} ({outcome_of(step)})", "", "```", (step.get("stderr_tail") or "").strip()
                      or (step.get("stdout_tail") or "").strip() or "(no output)", "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def write(args: argparse.Namespace) -> int:
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = [json.loads(line) for line in Path(args.manifest).read_text(encoding="utf-8").splitlines() if line.strip()]
    facts_found = None
    for step in steps:
        if step["kind"] == "facts" and step["status"] == "ran":
            facts_found = parse_facts(step)
    gpu_name = (facts_found or {}).get("gpu_name")
    log_parts = []
    for step in steps:
        if step["status"] != "ran":
            continue
        step["stdout_tail"], step["stderr_tail"] = tail(step["stdout"]), tail(step["stderr"])
        if step["kind"] == "pytest":
            step["pytest"] = parse_pytest(step, work / f"{step['name']}.xml")
        elif step["kind"] == "train":
            step["summary"] = parse_summary(step, gpu_name)
        for stream in ("stdout", "stderr"):
            log_parts.append(f"===== {step['name']} {stream} (exit {step['rc']}) =====\n{tail(step[stream], LOG_CHARS)}")
    device_line = "no CUDA device seen"
    if facts_found and facts_found.get("gpu_name"):
        device_line = (f"one {facts_found['gpu_name']} ({facts_found['gpu_memory_bytes'] / 2**30:.0f} GiB), "
                       f"torch {facts_found['torch']}, CUDA {facts_found['cuda_runtime']}, NCCL {facts_found.get('nccl')}")
    report = {"written": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "dry_run": args.dry_run, "device_line": device_line,
              "facts": facts_found, "steps": steps, "comparisons": comparisons(steps)}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (out / "gpu_check.md").write_text(markdown(report), encoding="utf-8")
    (out / "gpu_check.log").write_text("\n".join(log_parts) + "\n", encoding="utf-8")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("facts")
    rec = sub.add_parser("record")
    rec.add_argument("--manifest", required=True)
    rec.add_argument("--name", required=True)
    rec.add_argument("--kind", required=True, choices=("facts", "pytest", "train"))
    rec.add_argument("--status", required=True, choices=("ran", "dry_run", "skipped", "excluded"))
    rec.add_argument("--rc", type=int)
    rec.add_argument("--seconds", type=float)
    rec.add_argument("--timeout", type=int)
    rec.add_argument("--run-dir")
    rec.add_argument("--stdout")
    rec.add_argument("--stderr")
    rec.add_argument("command", nargs="*")
    wr = sub.add_parser("write")
    wr.add_argument("--manifest", required=True)
    wr.add_argument("--work", required=True)
    wr.add_argument("--out", required=True)
    wr.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.verb == "facts":
        return facts()
    return record(args) if args.verb == "record" else write(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
