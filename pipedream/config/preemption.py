"""``preemption.*`` read into ``PreemptionSpec`` (torch-free: the launcher reads it too); what a
preempted run does with it: ``pipedream.lifecycle.preemption``."""
from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

from pipedream.errors import ConfigError

# SIGTERM and SIGINT stop a job at once (launcher.grace_s); torchrun also ends on SIGHUP and SIGQUIT
SIGNALS = ("USR1", "USR2")


@dataclass(frozen=True)
class PreemptionSpec:
    signal: signal.Signals | None      # None: no preemption handling
    requeue_exit_code: int
    signal_before_s: int

    @property
    def signal_name(self) -> str | None:
        return self.signal.name.removeprefix("SIG") if self.signal is not None else None

    @classmethod
    def from_config(cls, cfg: Any) -> PreemptionSpec:
        section = cfg.preemption
        name = section.get("signal")
        sig = None
        if name is not None:
            short = str(name).upper().removeprefix("SIG")
            if short not in SIGNALS:
                raise ConfigError(f"preemption.signal={name} is not a preemption signal: use one of "
                                  f"{', '.join(SIGNALS)} (SIGTERM and SIGINT stop the job at once), or null to disable")
            sig = signal.Signals[f"SIG{short}"]
        code = section.get("requeue_exit_code")
        if not isinstance(code, int) or isinstance(code, bool) or not 3 <= code <= 125:
            raise ConfigError(f"preemption.requeue_exit_code={code} must be an integer from 3 to 125 "
                              f"(0-2 mean success and failures, 126 and up belong to the shell and signals)")
        before = section.get("signal_before_s")
        if not isinstance(before, int) or isinstance(before, bool) or before < 1:
            raise ConfigError(f"preemption.signal_before_s={before} must be a positive number of seconds: "
                              f"long enough for one training step and a checkpoint")
        return cls(sig, code, before)
