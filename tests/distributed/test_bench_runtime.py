"""The runtime benchmark's smoke run (--quick) and its Markdown section handling; no timings are
asserted (benchmarks are scripts that report, never timed tests)."""
from __future__ import annotations

import json
import subprocess
import sys

from scripts import ROOT
from scripts.bench.runtime_report import analyse, ceiling_note, ideal_bubble, replace_section


def test_quick_run_writes_json_and_markdown(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "scripts.bench.runtime", "--quick", "--out-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((tmp_path / "bench_runtime.json").read_text())
    cases = data["workloads"]["mlp"]["cases"]
    assert set(cases) == {"single-process", "single-process [both cores]", "pipedream gpipe", "torch gpipe",
                          "pipedream 1f1b", "torch 1f1b", "pipedream interleaved", "torch interleaved", "pipedream 2bw", "pipedream pipedream",
                          "pipedream 1f1b [plain autograd]", "pipedream 1f1b [no send-first]", "pipedream 1f1b [no delay]",
                          "pipedream zb_h2", "pipedream zbv", "pipedream dualpipev", "torch zbv", "torch interleaved_zb",
                          "torch dualpipev"}
    assert cases["pipedream zbv"]["vs_torch"]["median"] > 0 and 0 < cases["pipedream zbv"]["ideal_bubble"] < 0.2
    names = [t["name"] for t in data["targets"]]
    assert any(n.startswith("pipedream zb_h2 >= 100% of the ideal [both cores] (MLP)") for n in names)
    assert any(n.startswith("pipedream zbv >= 1.25x torch zbv (MLP") for n in names)
    assert any(n.startswith("pipedream dualpipev >= 1.15x torch dualpipev (STOCK") for n in names)
    stock = data["workloads"]["stock"]["cases"]   # torch's own modules, through the plugin path
    assert stock["pipedream zb_h2"]["speedup_vs_single"]["median"] > 0 and stock["torch zbv"]["step_time_s"]["median"] > 0
    assert data["settings"]["core_sets"] == [[0], [1]] or data["settings"]["core_sets"] is None
    assert cases["pipedream 1f1b [plain autograd]"]["vs_torch"]["median"] > 0
    assert cases["single-process [both cores]"]["speedup_vs_single"]["median"] > 0
    assert cases["pipedream 1f1b"]["of_ideal_both_cores"]["median"] > 0
    assert "vs_torch" not in cases["pipedream 2bw"] and cases["pipedream 2bw"]["ideal_bubble"] == 0.0
    assert all(row["step_time_s"]["min"] <= row["step_time_s"]["median"] <= row["step_time_s"]["max"]
               for row in cases.values())
    assert data["machine"]["cores"] and data["machine"]["torch"]
    # the quick stock plugin: [embedding, 2 encoder blocks, LayerNorm, Linear], one block per rank
    splits = data["workloads"]["stock"]["layers_per_stage"]
    assert splits["one chunk per rank"] == [2, 3] and sum(splits["V"]) == 5
    text = (tmp_path / "benchmarks.md").read_text()
    assert "Layers per stage (the default split" in text
    assert text.count("<!-- bench_runtime:begin -->") == 1 and "| pipedream 1f1b |" in text
    assert "Where our 1f1b's lead over torch's Schedule1F1B comes from" in text
    assert (tmp_path / "img" / "bench_runtime" / "mlp" / "timeline.png").exists()


def test_replace_section_keeps_other_sections(tmp_path) -> None:
    path = tmp_path / "benchmarks.md"
    path.write_text("# Benchmarks\n\n<!-- planner:begin -->\nplanner numbers\n<!-- planner:end -->\n")
    replace_section(path, "bench_runtime", "first")
    replace_section(path, "bench_runtime", "second")
    text = path.read_text()
    assert "planner numbers" in text and "second" in text and "first" not in text
    assert text.count("<!-- bench_runtime:begin -->") == 1


def test_ratios_are_pairwise() -> None:
    times = {"single-process": [1.0, 2.0], "pipedream 1f1b": [0.5, 1.0], "torch 1f1b": [1.0, 1.0]}
    rows = analyse(times, global_batch=8, microbatches=8, pp=2)
    assert rows["pipedream 1f1b"]["vs_torch"] == {"median": 1.5, "min": 1.0, "max": 2.0}
    assert rows["pipedream 1f1b"]["speedup_vs_single"]["median"] == 2.0
    assert rows["pipedream 1f1b"]["of_ideal"]["median"] == (1 / (2 * (1 - ideal_bubble("1f1b", 8, 2)))) / 0.5
    assert ideal_bubble("interleaved", 8, 2) == 1 / 17


def test_both_cores_row_and_its_ideal() -> None:
    times = {"single-process": [1.0, 1.0], "single-process [both cores]": [1.25, 2.0], "pipedream 1f1b": [0.5, 0.5]}
    rows = analyse(times, global_batch=8, microbatches=8, pp=2)
    assert rows["single-process [both cores]"]["speedup_vs_single"] == {"median": 0.65, "min": 0.5, "max": 0.8}
    ideal_alone = 1 / (2 * (1 - ideal_bubble("1f1b", 8, 2)))
    assert rows["pipedream 1f1b"]["of_ideal"]["median"] == ideal_alone / 0.5
    assert rows["pipedream 1f1b"]["of_ideal_both_cores"]["median"] == (1.25 + 2.0) / 2 * ideal_alone / 0.5


def test_target_cases_run_back_to_back() -> None:
    from scripts.bench.runtime import run_order

    names = ["single-process", "pipedream gpipe", "pipedream 1f1b", "torch 1f1b", "pipedream 2bw"]
    assert run_order(names) == ["torch 1f1b", "pipedream 1f1b", "single-process", "pipedream gpipe", "pipedream 2bw"]


def test_targets_only_keeps_the_cases_the_targets_compare() -> None:
    from scripts.bench.runtime_cases import cases

    schedules = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")
    for workload in ("mlp", "gpt", "stock"):
        kept = {c.name for c in cases(workload, targets_only=True)}
        assert {"single-process", "single-process [both cores]", "torch interleaved_zb", "pipedream zb_h2"} <= kept
        assert {f"{r} {s}" for r in ("pipedream", "torch") for s in schedules} <= kept
        assert not any("[" in n and "both cores" not in n for n in kept)
        assert kept < {c.name for c in cases(workload)}


def test_schedule_targets_pair_each_schedule_with_its_counterpart() -> None:
    from scripts.bench.runtime_targets import schedule_targets

    def row(times):
        return {"times_s": times, "step_time_s": {"median": sorted(times)[len(times) // 2]}}
    cases = {"pipedream 1f1b": row([1.0, 2.0, 1.0]), "torch 1f1b": row([1.1, 2.0, 1.0]),
             "pipedream zb_h2": row([1.0, 1.0, 1.0]), "torch zbv": row([1.2, 1.2, 1.2]),
             "torch interleaved_zb": row([1.5, 1.5, 1.5])}
    found = {t["name"].split(" >=")[0]: t for t in schedule_targets(cases, "gpt", 1.05)}
    assert found["pipedream 1f1b"]["value"] == 1.0 and not found["pipedream 1f1b"]["met"]
    assert "torch zbv" in found["pipedream zb_h2"]["name"] and found["pipedream zb_h2"]["value"] == 1.2
    assert found["pipedream zb_h2"]["met"] and set(found) == {"pipedream 1f1b", "pipedream zb_h2"}


def test_generated_text_describes_only_rows_that_ran() -> None:
    from scripts.bench.runtime_report import limits, rows_note

    targets_only = {"single-process", "single-process [both cores]", "pipedream 1f1b", "torch 1f1b", "pipedream zbv",
                    "torch zbv"}
    note = rows_note(targets_only)
    assert "[both cores]" in note and "Zero-bubble rows" in note
    assert "[plain autograd]" not in note and "asynchronous" not in note
    full = rows_note(targets_only | {"pipedream 1f1b [plain autograd]", "pipedream 2bw"})
    assert "[plain autograd]" in full and "asynchronous" in full
    times = {"single-process": [1.0, 1.0], "pipedream 1f1b": [0.55, 0.6], "torch 1f1b": [0.56, 0.6]}
    workload = {"cases": analyse(times, global_batch=8, microbatches=8, pp=2), "microbatches": 8, "traced": None}
    data = {"workloads": {"mlp": workload, "gpt": workload}, "settings": {"pp": 2},
            "targets": [{"name": "pipedream 1f1b >= 1.05x torch 1f1b (GPT, per-round throughput ratio)", "met": False},
                        {"name": "our 1f1b >= 1.10x the throughput of torch Schedule1F1B (MLP)", "met": True}]}
    text = " ".join(limits(data))
    assert text.startswith("What limits it (GPT)") and "(MLP)" not in text


def test_ceiling_is_the_slowest_stage_back_to_back() -> None:
    workload = {"microbatches": 8, "cases": {"torch 1f1b": {"step_time_s": {"median": 0.240}}}}
    text = ceiling_note(workload, slowest=0.024)
    assert "takes 192.0 ms" in text and "at most 1.25x faster than torch's 1f1b (240.0 ms)" in text
    assert ceiling_note({"microbatches": 8, "cases": {}}, slowest=0.024) == ""
