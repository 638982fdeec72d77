"""torchrun as the launcher runs it: the same command line, but

- stopped by a signal it ends with 128 + the signal's number instead of a traceback;
- a rank that exits with a final code (``pipedream.errors.REFUSED_EXIT`` / ``FINAL_EXIT``: bad
  config, bad data, NaN, no usable checkpoint) is not restarted ``--max-restarts`` times, since the
  same input fails the same way;
- a failure the ranks already reported in one line is not reported again as torchrun's
  ``ChildFailedError`` traceback, nor are the ranks torchrun then stopped; a rank killed by a signal
  (which printed nothing) gets one line, SIGKILL named as the likely out-of-memory kill;
- a rendezvous that fails (a node that never joins within ``launcher.rendezvous_timeout_s``) is one line,
  and so is losing it while training (the node that hosts it died), without the C++ store client's
  stack traces;
- it ends when the launcher that started it dies, even by SIGKILL, and its ranks end with it
  (``pipedream.lifecycle.parent_watch``).

A leading ``--elastic-last-call=S`` makes the agent elastic (``launcher.elastic_agent``). Leading
``--ignore-signal=NAME`` options (the preemption signal) make torchrun ignore that signal:
its default action would end torchrun, and the ranks it starts inherit the ignored state until they
install their own handler.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from pipedream.errors import FINAL_EXIT, REFUSED_EXIT, stderr_line
from pipedream.lifecycle.parent_watch import watch_parent

from launcher.elastic_agent import OPTION as ELASTIC, make_elastic

FINAL_CODES = (REFUSED_EXIT, FINAL_EXIT)
IGNORE = "--ignore-signal="
CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"


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


def note_worker_starts(started: threading.Event) -> None:
    """Sets ``started`` once torchrun starts this node's ranks: a rendezvous error after that is a node
    lost while training, not one that never joined."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    start = LocalElasticAgent._start_workers

    def start_and_note(self, worker_group):
        started.set()
        return start(self, worker_group)

    LocalElasticAgent._start_workers = start_and_note   # this process runs one torchrun


def import_torch_without_cpp_warnings() -> None:
    """Loads torch with its C++ warnings off in this process: the store client prints a stack trace
    when the node hosting the rendezvous dies, which ``lost_rendezvous_line`` says in one line. torch
    reads the level once, as it loads; the ranks, started later, get the environment as it was."""
    chosen = os.environ.get(CPP_LOG_LEVEL)   # a level the user set is kept
    os.environ.setdefault(CPP_LOG_LEVEL, "ERROR")
    try:
        import torch  # noqa: F401
    finally:
        if chosen is None:
            del os.environ[CPP_LOG_LEVEL]


def drop_node_rank_notice(record: logging.LogRecord) -> bool:
    """torchrun warns on every node but the first that c10d ignores ``--node-rank`` (it numbers the
    nodes as they join); the launcher passes it for the record only, so the warning is noise."""
    return not record.getMessage().startswith("node_rank is only used for static rdzv_backend")


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


def _options(argv: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in argv if arg.startswith("--") and "=" in arg)


def _described(error: Exception) -> str:
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}{': ' + first if first and first != type(error).__name__ else ''}"


def rendezvous_line(error: Exception, argv: list[str]) -> str:
    options = _options(argv)
    conf = dict(item.split("=", 1) for item in options.get("rdzv-conf", "").split(",") if "=" in item)
    waited = conf.get("join_timeout", "?")
    return (f"error: the {options.get('nnodes', '?').replace(':', '..')} nodes did not all join the rendezvous at "
            f"{options.get('rdzv-endpoint', '?')} within launcher.rendezvous_timeout_s={waited} "
            f"({_described(error)}): start every node's command (the same launcher.master_addr and master_port, "
            f"its own launcher.node_rank), or raise launcher.rendezvous_timeout_s")


def lost_rendezvous_line(error: Exception, argv: list[str]) -> str:
    return (f"error: this node lost the rendezvous at {_options(argv).get('rdzv-endpoint', '?')} while training "
            f"({_described(error)}): the node hosting it stopped (its own output says why) or cannot be reached; "
            f"start every node's command again (train.resume=auto continues from the newest checkpoint)")


def main(argv: list[str]) -> int:
    watch_parent()   # first: the launcher may already be gone; also tells the ranks this PID
    last_call_s = None
    while argv and argv[0].startswith((IGNORE, ELASTIC)):   # before the slow imports below
        if argv[0].startswith(ELASTIC):
            last_call_s = float(argv[0].removeprefix(ELASTIC))
        else:
            signal.signal(signal.Signals[f"SIG{argv[0].removeprefix(IGNORE)}"], signal.SIG_IGN)
        argv = argv[1:]
    import_torch_without_cpp_warnings()
    if last_call_s is not None:
        make_elastic(last_call_s)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousError
    from torch.distributed.run import main as torchrun

    # torchrun's own log lines repeat what the ranks print in one line
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.run").addFilter(drop_node_rank_notice)
    stop_restarts_on_final_codes()
    started = threading.Event()
    note_worker_starts(started)
    try:
        torchrun(argv)
    except SignalException as stop:
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:
        return report_child_failure(failed.failures)
    except RendezvousError as error:
        lost = started.is_set() and isinstance(error, RendezvousConnectionError)
        stderr_line(lost_rendezvous_line(error, argv) if lost else rendezvous_line(error, argv))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
