"""What the launcher tells the user about a job before it starts: the layout in one line (degrees,
schedule and the layer split the run spec chose), and warnings for settings that run but rarely
mean what was intended."""
from __future__ import annotations

from typing import Any


def layout_line(spec: Any) -> str:
    """``1f1b pp=4 tp=1 dp=1, layers per stage [2, 2, 1, 1]`` (per virtual stage with chunks; a
    harmony run names its packs instead: one device holds every layer in turn)."""
    head = f"{spec.schedule.name} {spec.layout.degrees()}"
    if spec.harmony is not None:
        config = spec.harmony.config
        return (f"{head}, layers per forward pack {[e - s for s, e in config.forward_packs]}, "
                f"per backward pack {[e - s for s, e in config.backward_packs]}")
    sizes = [end - start for start, end in spec.bounds]
    where = "stage" if len(sizes) == spec.layout.pp else "virtual stage"
    vpp = f" vpp={spec.layout.vpp}" if spec.layout.vpp > 1 else ""
    return f"{head}{vpp}, layers per {where} {sizes}"


def launch_warnings(cfg: Any, procs_here: int, cores_here: int) -> list[str]:
    """One line each: more ranks than this node's usable cores (they take turns on the cores, and
    every collective waits for the slowest), and a run that never leaves learning-rate warm-up."""
    notes = []
    if procs_here > cores_here:
        notes.append(f"{procs_here} ranks on this node share {cores_here} usable CPU core(s): each step waits for "
                     f"ranks taking turns on a core (several times slower); use fewer ranks (parallel.pp/tp/dp) "
                     f"or a machine with at least {procs_here} cores")
    steps, warmup = int(cfg.train.steps), int(cfg.train.warmup_steps)
    if 0 < warmup and steps <= warmup:
        notes.append(f"train.steps={steps} <= train.warmup_steps={warmup}: the learning rate only warms up (the "
                     f"last step runs at {steps / warmup:.0%} of train.lr, with no decay): lower "
                     f"train.warmup_steps (e.g. train.warmup_steps={max(1, steps // 10)}) or raise train.steps")
    return notes
