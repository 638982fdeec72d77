"""One attempt of an elastic run, as the ranks see it (the design: docs/reliability.md).

- The record: ``<run_dir>/elastic.jsonl`` keeps, across the attempts torchrun starts, when each began
  (its world size, degrees and resume step), when a rank saw the world break and after which step, and
  when the first step after a re-formed start completed. The summary's ``layouts`` (which degrees ran
  which steps) and ``recoveries`` (failure to first step done again) are read from it.
- Scaling up: the launch agent sends ``SIGUSR2`` to its ranks when a node waits to join. The handler
  only sets a flag; after every step the ranks take the maximum of their flags (one integer, on a Gloo
  group of their own), so all of them save that step's checkpoint together and end with
  ``REFORM_EXIT``, on which torchrun re-forms the world with the waiting node.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipedream.config.elastic import REFORM_SIGNAL

EVENTS = "elastic.jsonl"
REFORM_EXIT = 4   # the ranks saved a checkpoint so that a joining node can be taken in: not a failure


class ReformRequested(Exception):
    """Raised out of the step loop once the checkpoint for a re-formed world is saved."""

    def __init__(self, step: int):
        super().__init__(f"re-forming the world after step {step} (a node joined)")
        self.step = step


def append_event(run_dir: Path, event: dict[str, Any]) -> None:
    """One JSON line, written with a single ``write`` on an O_APPEND file: ranks on several nodes may
    append at once and no line is cut by another."""
    line = (json.dumps({**event, "time": time.time()}) + "\n").encode()
    fd = os.open(run_dir / EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / EVENTS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class ElasticRun:
    """This rank's part in the record, and the re-form request, from the start of the step loop."""

    def __init__(self, enabled: bool, run_dir: Path, rank: int, world_size: int, degrees: dict[str, int],
                 timeout: Any):
        self.enabled, self.run_dir, self.rank = enabled, run_dir, rank
        self.layout = {**degrees, "world_size": world_size}
        self.requested_flag = False
        self.awaiting_first_step = False
        self._group = None
        if not enabled:
            return
        if threading.current_thread() is threading.main_thread():   # Python handles signals there only
            signal.signal(signal.Signals[f"SIG{REFORM_SIGNAL}"], self._on_signal)
        if world_size > 1:
            self._group = dist.new_group(backend="gloo", timeout=timeout)

    def _on_signal(self, _signum: int, _frame: Any) -> None:
        self.requested_flag = True

    def started(self, resumed_after: int) -> None:
        """Rank 0 records this attempt's layout and where it resumed."""
        if not self.enabled or self.rank != 0:
            return
        earlier = read_events(self.run_dir)
        self.awaiting_first_step = bool(earlier)   # an attempt after another: its first step ends a recovery
        append_event(self.run_dir, {"event": "start", "resumed_after": resumed_after,
                                    "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), **self.layout})

    def step_done(self, step: int) -> None:
        if self.awaiting_first_step:
            self.awaiting_first_step = False
            append_event(self.run_dir, {"event": "first_step", "step": step})
            print(f"elastic: step {step} done on {self.layout['world_size']} devices after re-forming", flush=True)

    def failed(self, steps_done: int) -> None:
        """Any rank: the world broke under it after ``steps_done`` steps (it is about to exit)."""
        if self.enabled:
            append_event(self.run_dir, {"event": "failure", "rank": self.rank, "after_step": steps_done})

    def reform_requested(self) -> bool:
        """Collective (when enabled): whether any rank's agent asked for a re-form."""
        if self._group is None:
            return self.requested_flag
        flag = torch.tensor([int(self.requested_flag)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def reform(self, step: int) -> None:
        if self.rank == 0:
            append_event(self.run_dir, {"event": "reform", "after_step": step})
            print(f"elastic: a node joined; checkpoint after step {step} saved, the world re-forms", flush=True)
        raise ReformRequested(step)

    def summary(self, steps: int) -> dict[str, Any]:
        """``layouts`` and ``recoveries`` for summary.json (rank 0, at the end of the run)."""
        return history(read_events(self.run_dir), steps) if self.enabled else {}


def history(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """The step ranges each layout ran (a range cut by a failure ends at the last step done: the steps
    after the checkpoint are done again by the next layout), and each re-form's cause and time."""
    layouts: list[dict[str, Any]] = []
    recoveries: list[dict[str, Any]] = []
    interruption: dict[str, Any] | None = None   # the failure or re-form since the last start
    pending: dict[str, Any] | None = None        # a recovery waiting for its first step
    for event in events:
        kind = event["event"]
        if kind in ("failure", "reform"):
            if layouts and layouts[-1]["steps"][1] is None:
                layouts[-1]["steps"][1] = event["after_step"]
            if interruption is None or kind == "failure" and interruption["event"] == "failure" \
                    and event["time"] < interruption["time"]:
                interruption = event   # the earliest rank to see the failure
        elif kind == "start":
            if layouts and layouts[-1]["steps"][1] is None:   # a start with nothing seen (a killed rank 0)
                layouts[-1]["steps"][1] = event["resumed_after"]
            layouts.append({"steps": [event["resumed_after"] + 1, None],
                            **{k: event[k] for k in ("pp", "tp", "cp", "dp", "world_size")}})
            if len(layouts) > 1:
                cause = interruption or {"event": "failure", "time": None, "after_step": None}
                pending = {"cause": "node joined" if cause["event"] == "reform" else "failure",
                           "world_size": [layouts[-2]["world_size"], event["world_size"]],
                           "interrupted_after_step": cause["after_step"], "resumed_after_step": event["resumed_after"],
                           "steps_redone": (cause["after_step"] - event["resumed_after"]
                                            if cause["after_step"] is not None else None),
                           "detected_at": cause["time"], "restarted_at": event["time"]}
                recoveries.append(pending)
            interruption = None
        elif kind == "first_step" and pending is not None:
            pending["first_step_at"] = event["time"]
            pending["seconds"] = event["time"] - pending["detected_at"] if pending["detected_at"] else None
            pending = None
    if layouts and layouts[-1]["steps"][1] is None:
        layouts[-1]["steps"][1] = steps
    return {"layouts": layouts, "recoveries": recoveries}
