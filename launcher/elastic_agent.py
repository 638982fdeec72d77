"""torchrun's elastic agent as an elastic job runs it (``launcher.min_nodes`` < ``launcher.nnodes``):

- the ranks learn the rendezvous round (``PIPEDREAM_WORLD_ROUND``): nodes that joined at different
  times have restarted different numbers of times, and the ranks key their process-group start-up by
  something every node of the world agrees on;
- the first world waits for every node (up to ``launcher.rendezvous_timeout_s``, as a fixed-size job
  does); once it has formed, a re-formed world waits only ``launcher.last_call_s`` for more nodes, so
  a survivor continues quickly;
- a node waiting to join does not make torchrun kill the ranks at once (its default, which loses the
  steps since the last checkpoint): the agent sends its ranks ``SIGUSR2``, they save a checkpoint at
  the next step boundary and end with ``REFORM_EXIT``, and torchrun's restart then takes the node in
  (a restart: ``launcher.max_restarts`` counts membership changes, a node lost or a node joined).
"""
from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

from pipedream.config.elastic import REFORM_SIGNAL, WORLD_ROUND, ElasticSpec

OPTION = "--elastic-last-call="
UNSHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# a rank ignores the signal until its handler is installed (the agent ignores it, the ranks inherit
# that): repeated until the ranks end (the handler only sets a flag)
RESEND_S = 1.0


def elastic_agent_options(cfg: Any, spec: ElasticSpec) -> list[str]:
    """``launcher.agent``'s options for an elastic job: the last call of a re-formed world, and the
    re-form signal ignored until the ranks install their handler."""
    if not spec.enabled:
        return []
    return [f"{OPTION}{float(cfg.launcher.last_call_s):g}", f"--ignore-signal={REFORM_SIGNAL}"]


def _round_of(handler: Any) -> str | None:
    """The c10d rendezvous round just completed (torch keeps it in the handler's state holder)."""
    holder = getattr(handler, "_state_holder", None)
    return str(holder.state.round) if holder is not None else None


def _shorten_last_call(handler: Any, seconds: float) -> None:
    """After the first world formed: later rendezvous complete ``seconds`` after the fewest nodes."""
    settings = getattr(handler, "_settings", None)
    if settings is not None:
        settings.timeout._last_call = timedelta(seconds=seconds)


def make_elastic(last_call_s: float) -> None:
    """Patches torchrun's local agent (this process runs one torchrun) as the module describes."""
    # torch shares one store for the ranks across rounds, made when a node first forms a world: a node
    # joining later waits for its address under the new round, where nobody writes it. Without sharing,
    # every round's rank 0 publishes a store of its own (a documented opt-out)
    os.environ[UNSHARED_STORE] = "1"
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    start, monitor = LocalElasticAgent._start_workers, LocalElasticAgent._monitor_workers

    def start_with_round(self, worker_group):
        handler = worker_group.spec.rdzv_handler
        round_ = _round_of(handler)
        if round_ is not None:
            os.environ[WORLD_ROUND] = round_   # the ranks inherit the agent's environment
        _shorten_last_call(handler, last_call_s)
        self._reform_sent_at = None
        return start(self, worker_group)

    def monitor_and_ask_for_reform(self, worker_group):
        result = monitor(self, worker_group)
        handler = worker_group.spec.rdzv_handler
        waiting = getattr(self, "_nodes_waiting", None)
        if waiting is None:   # torchrun's loop restarts at once when nodes wait: it now never sees them
            waiting = self._nodes_waiting = handler.num_nodes_waiting
            handler.num_nodes_waiting = lambda: 0
        sent_at = self._reform_sent_at
        due = sent_at is None or time.monotonic() - sent_at >= RESEND_S
        if result.state == WorkerState.HEALTHY and due and self._remaining_restarts > 0 and waiting() > 0:
            self._reform_sent_at = time.monotonic()
            for pid in self._pcontext.pids().values():
                try:
                    os.kill(pid, signal.Signals[f"SIG{REFORM_SIGNAL}"])
                except OSError:   # already gone
                    pass
        return result

    LocalElasticAgent._start_workers = start_with_round
    LocalElasticAgent._monitor_workers = monitor_and_ask_for_reform
