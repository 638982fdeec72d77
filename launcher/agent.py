"""torchrun as the launcher runs it: the same command line, but

- stopped by a signal it ends with 128 + the signal's number instead of a traceback;
- a rank that exits with a final code (``pipedream.errors.REFUSED_EXIT`` / ``FINAL_EXIT``: bad
  config, bad data, NaN, no usable checkpoint) is not restarted ``--max-restarts`` times, since the
  same input fails the same way;
- a failure the ranks already reported in one line is not reported again as torchrun's
  ``ChildFailedError`` traceback, nor are the ranks torchrun then stopped; a rank killed by a signal
  (which printed nothing) gets one line, SIGKILL named as the likely out-of-memory kill;
- a rendezvous that fails (a node that never joins within ``launcher.rendezvous_timeout_s``) is one line.

Leading ``--ignore-signal=NAME`` options (the preemption signal) make torchrun ignore that signal:
its default action would end torchrun, and the ranks it starts inherit the ignored state until they
install their own handler.
"""
from __future__ import annotations

import logging
import signal
import sys

from pipedream.errors import FINAL_EXIT, REFUSED_EXIT, stderr_line

FINAL_CODES = (REFUSED_EXIT, FINAL_EXIT)
IGNORE = "--ignore-signal="


def stop_restarts_on_final_codes() -> None:
    """torchrun restarts a failed worker group while restarts remain, whatever the exit codes: end the
    restarts when a rank reports a deterministic failure."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers

    def monitor_without_futile_restarts(self, worker_group):
        result = monitor(self, worker_group)
        if any(failure.exitcode in FINAL_CODES for failure in result.failures.values()):
            self._remaining_restarts = 0
        return result

    LocalElasticAgent._monitor_workers = monitor_without_futile_restarts   # this process runs one torchrun


def killed_line(rank: int, exitcode: int) -> str:
    name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else f"signal {-exitcode}"
    if -exitcode == signal.SIGKILL:
        return (f"error: rank {rank} was killed by SIGKILL, most likely out of memory (the kernel's OOM killer; "
                f"`dmesg` tells): lower train.micro_batch_size, use more pipeline stages or "
                f"recompute.granularity=full")
    return f"error: rank {rank} was killed by {name}"


def report_child_failure(failures: dict) -> int:
    """One line per rank that failed by itself without a word (killed by a signal); the ranks torchrun
    then stopped with SIGTERM are not causes. Returns the job's exit code: a final code if a rank gave
    one, else the first cause's (128 + the signal for a killed rank)."""
    causes = {rank: failure for rank, failure in failures.items()
              if failure.exitcode > 0 or -failure.exitcode not in (signal.SIGTERM, signal.SIGINT)} or failures
    codes = []
    for rank, failure in sorted(causes.items()):
        if failure.exitcode < 0:
            stderr_line(killed_line(rank, failure.exitcode))
        codes.append(failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode)
    return next((code for code in codes if code in FINAL_CODES), codes[0])


def rendezvous_line(error: Exception, argv: list[str]) -> str:
    options = dict(arg[2:].split("=", 1) for arg in argv if arg.startswith("--") and "=" in arg)
    waited = options.get("rdzv-conf", "").removeprefix("join_timeout=")
    first = (str(error).strip().splitlines() or [""])[0]
    return (f"error: the {options.get('nnodes', '?')} nodes did not all join the rendezvous at "
            f"{options.get('rdzv-endpoint', '?')} within launcher.rendezvous_timeout_s={waited} "
            f"({type(error).__name__}{': ' + first if first and first != type(error).__name__ else ''}): start "
            f"every node's command (the same launcher.master_addr and master_port, its own launcher.node_rank), "
            f"or raise launcher.rendezvous_timeout_s")


def main(argv: list[str]) -> int:
    while argv and argv[0].startswith(IGNORE):   # before the slow imports below
        signal.signal(signal.Signals[f"SIG{argv[0].removeprefix(IGNORE)}"], signal.SIG_IGN)
        argv = argv[1:]
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main as torchrun

    # torchrun's own log lines repeat what the ranks print in one line
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    stop_restarts_on_final_codes()
    try:
        torchrun(argv)
    except SignalException as stop:
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:
        return report_child_failure(failed.failures)
    except RendezvousError as error:
        stderr_line(rendezvous_line(error, argv))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
