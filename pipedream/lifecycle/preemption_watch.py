"""Stopping a run for preemption at a step boundary that every rank agrees on.

The signal handler only sets a flag: the signal may reach some ranks and not others (the launcher
relays it, SLURM may deliver it to every process), and at different moments. After every step the
ranks take the maximum of their flags with one all-reduce of a single integer on a Gloo group of
their own (cheap, and never interleaved with the pipeline's traffic), so all of them see the request
after the same step, save that step's checkpoint together and stop.
"""
from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipedream.checkpoint.store import RunCheckpoints
from pipedream.runtime.distributed import DistContext
from pipedream.config.preemption import PreemptionSpec
from pipedream.lifecycle.preemption import clear_marker, write_marker


class PreemptionWatch:
    """One rank's view of the preemption signal, from the start of the step loop to ``close()``."""

    def __init__(self, spec: PreemptionSpec, ctx: DistContext, run_dir: Path):
        self.spec, self.rank, self.run_dir = spec, ctx.rank, run_dir
        self.signalled = False
        self._previous: Any = None
        self._group = None
        if spec.signal is None:
            return
        if threading.current_thread() is threading.main_thread():   # Python handles signals there only
            self._previous = signal.signal(spec.signal, self._on_signal)
        if ctx.world_size > 1:
            self._group = dist.new_group(backend="gloo", timeout=ctx.timeout)
        if self.rank == 0:
            clear_marker(run_dir)   # a record left by the attempt this one resumes

    def _on_signal(self, _signum: int, _frame: Any) -> None:
        self.signalled = True

    def requested(self) -> bool:
        """Collective (when enabled): whether any rank has received the signal."""
        if self._group is None:
            return self.signalled
        flag = torch.tensor([int(self.signalled)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def stop(self, step: int, checkpoints: RunCheckpoints) -> Path:
        """Collective: saves the checkpoint after ``step`` and records the stop (rank 0)."""
        path = checkpoints.save(step)
        if self.rank == 0:
            write_marker(self.run_dir, {"step": step, "signal": self.spec.signal_name, "checkpoint": str(path)})
            print(f"preemption: SIG{self.spec.signal_name} received; stopped after step {step} with checkpoint "
                  f"{path} (a run with train.resume=auto continues from it)", flush=True)
        return path

    def close(self) -> None:
        """Puts the previous handler back, but a late signal (the launcher repeats it) must not end a
        rank that is finishing: the default action becomes "ignore"."""
        if self._previous is not None:
            signal.signal(self.spec.signal, signal.SIG_IGN if self._previous == signal.SIG_DFL else self._previous)
            self._previous = None
