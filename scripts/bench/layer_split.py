"""The default layer split against an even split by layer count: the slowest rank's forward + backward
per micro-batch under each, from every layer's own measured time.

Each layer of a model runs forward and backward alone (one thread, the config's micro-batch, best
of ``--repeats``); a split's pace is its slowest rank's sum, where a rank holds one stage, or two in
a V (zbv, dualpipev: stages r and 2p-1-r). The balanced split is the one the runtime takes by
default (``pipedream/config/balance.py``, from FLOPs and operators counted on the meta device); the
even one is what it took before. Measured times, not the estimate, decide which is faster here.

Run: .venv/bin/python -m scripts.bench.layer_split [--repeats 5] [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path
from typing import Any

import torch

from scripts import ROOT
from scripts.bench.runtime_report import machine, write_report

SECTION = "bench_layer_split"
NOISE = 0.97   # a pace ratio closer to 1 than this is within best-of-5 timing noise
STOCK = "scripts.bench.runtime_stock_model"
IMAGES = ["data=synthetic_images"]
ONE, V = "one chunk", "V"
# (label, overrides, [(pipeline size, placement)])
CASES = [
    ("gpt_tiny", ["model=gpt_tiny"], [(2, ONE), (2, V), (4, ONE)]),
    ("gpt_small", ["model=gpt_small"], [(4, ONE)]),
    ("llama_tiny", ["model=llama_tiny"], [(2, V), (4, ONE)]),
    ("vgg16_small", ["model=vgg16_small", *IMAGES], [(2, ONE), (4, ONE)]),
    ("resnet50_small", ["model=resnet50_small", *IMAGES], [(2, ONE), (4, ONE)]),
    ("torch modules (plugin)", [f"model._target_={STOCK}.build", f"data._target_={STOCK}.data",
                                "train.micro_batch_size=8", "train.global_batch_size=64"], [(2, ONE), (2, V)]),
]
QUICK = [("gpt_tiny (2 blocks, hidden 32)", ["model=gpt_tiny", "model.num_layers=2", "model.hidden_size=32",
                                             "model.num_heads=2", "model.seq_len=16"], [(2, ONE), (2, V)])]


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.is_floating_point())
    return tuple(_detached(member) for member in value)


def _outputs(value: Any) -> list[torch.Tensor]:
    members = [value] if isinstance(value, torch.Tensor) else list(value)
    return [t for t in members if t.requires_grad]


def layer_times(overrides: list[str], repeats: int) -> list[float]:
    """Seconds of each layer's forward + backward alone (the last one's with the loss)."""
    from models import boundary, build_model
    from pipedream.config.loading import compose_config

    cfg = compose_config(overrides)
    model = build_model(cfg.model, seed=0)
    layers = model.build()
    value, target = model.make_batch(int(cfg.train.micro_batch_size), torch.Generator().manual_seed(0))
    times = []
    for index in range(model.num_layers):
        inputs, best = _detached(value), float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            out = boundary.call_layer(layers[index], inputs)
            last = index == model.num_layers - 1
            (model.loss_fn(out, target) if last else sum(t.float().sum() for t in _outputs(out))).backward()
            best = min(best, time.perf_counter() - start)
        times.append(best)
        with torch.no_grad():
            value = boundary.call_layer(layers[index], inputs)
    return times


def pace(times: list[float], bounds: list[tuple[int, int]], placement: str) -> float:
    """The slowest rank's seconds per micro-batch: one stage per rank, or stages r and 2p-1-r."""
    stages = [sum(times[start:end]) for start, end in bounds]
    if placement == V:
        ranks = len(stages) // 2
        return max(stages[r] + stages[2 * ranks - 1 - r] for r in range(ranks))
    return max(stages)


def measure(cases: list, repeats: int) -> list[dict[str, Any]]:
    from pipedream.config.layout import split_layers
    from pipedream.config.loading import compose_config
    from pipedream.config.run_spec import build_run_spec

    rows = []
    for label, overrides, layouts in cases:
        times = layer_times(overrides, repeats)
        for pp, placement in layouts:
            schedule = ["schedule=zbv"] if placement == V else []
            spec = build_run_spec(compose_config([*overrides, *schedule, f"parallel.pp={pp}"]))
            balanced = list(spec.bounds)
            even = split_layers(len(times), len(balanced))
            rows.append({"model": label, "pp": pp, "placement": placement, "layers": len(times),
                         "even": [end - start for start, end in even],
                         "balanced": [end - start for start, end in balanced],
                         "even_pace_s": pace(times, even, placement),
                         "balanced_pace_s": pace(times, balanced, placement),
                         "layer_times_s": times})
            print(f"{label} pp={pp} {placement}: even {rows[-1]['even']} {rows[-1]['even_pace_s'] * 1e3:.2f} ms, "
                  f"balanced {rows[-1]['balanced']} {rows[-1]['balanced_pace_s'] * 1e3:.2f} ms", flush=True)
    return rows


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = ["## The default layer split against an even split", "",
             f"Measured by `python -m scripts.bench.layer_split` on {report['date']}: {m['cpu']} ({m['cores']} cores), "
             f"torch {m['torch']}, one thread. Every layer's forward + backward alone at the config's micro-batch "
             f"(best of {report['repeats']}); a split's pace is its slowest rank's sum of those times per micro-batch "
             "(V: the rank holds stages r and 2p-1-r, as zbv and dualpipev place them). *Default split*: the runtime's "
             "(stages of equal estimated cost, `pipedream/config/balance.py`); *even split*: by layer count, the "
             "default before. The raw numbers are in `docs/bench_layer_split.json`.", "",
             "| model | pp | placement | even split | its pace | default split | its pace | pace gain |",
             "|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        gain = row["even_pace_s"] / row["balanced_pace_s"]
        lines.append(f"| {row['model']} | {row['pp']} | {row['placement']} | {row['even']} | "
                     f"{row['even_pace_s'] * 1e3:.2f} ms | {row['balanced']} | {row['balanced_pace_s'] * 1e3:.2f} ms | "
                     f"{gain:.2f}x |")
    worst = min(row["even_pace_s"] / row["balanced_pace_s"] for row in report["rows"])
    verdict = (f"The default split is nowhere slower than the even one beyond the timing's noise (lowest gain "
               f"{worst:.2f}x)." if worst >= NOISE else
               f"In at least one case the default split is slower than the even one ({worst:.2f}x): the estimate "
               f"misjudges those layers.")
    return "\n".join(lines + ["", verdict, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one tiny model (a smoke run)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench_layer_split"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure(QUICK if args.quick else CASES, args.repeats)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": machine(), "repeats": args.repeats, "rows": rows}
    write_report(Path(args.out), report, markdown(report), SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
