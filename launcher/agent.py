"""torchrun as the launcher runs it: the same command line, but stopped by a signal it ends with
128 + the signal's number instead of a traceback.

Leading ``--ignore-signal=NAME`` options (the preemption signal) make torchrun ignore that signal:
its default action would end torchrun, and the ranks it starts inherit the ignored state until they
install their own handler."""
from __future__ import annotations

import signal
import sys

IGNORE = "--ignore-signal="


def main(argv: list[str]) -> int:
    while argv and argv[0].startswith(IGNORE):   # before the slow imports below
        signal.signal(signal.Signals[f"SIG{argv[0].removeprefix(IGNORE)}"], signal.SIG_IGN)
        argv = argv[1:]
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as stop:
        return 128 + int(stop.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
