"""torchrun as the launcher runs it: the same command line, but stopped by a signal it ends with
128 + the signal's number instead of a traceback."""
from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as stop:
        return 128 + int(stop.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
