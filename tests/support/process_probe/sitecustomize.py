"""Loaded by every Python process of a test that puts this folder first on PYTHONPATH (tests/support/processes.py).

PROBE_LOG: each process appends its command line, so a test can tell whether torchrun or a rank ever
started. PROBE_FAULT=<rank|all>:<kind>:<seconds>: a training rank (RANK) injects a fault that long
after start: ``sigkill`` (what the kernel's out-of-memory killer does) or ``raise`` (an error of its
own on the main thread, through SIGUSR2: SIGUSR1 is the preemption signal), raised inside a
training step (until one runs, the signal is sent again every 0.2 s)."""
import os
import sys


def _record() -> None:
    with open("/proc/self/cmdline", "rb") as source:
        command = source.read().replace(b"\0", b" ").decode(errors="replace")
    with open(os.environ["PROBE_LOG"], "a") as log:
        log.write(command + "\n")


def _inject(rank: str, kind: str, delay: float) -> None:
    import signal
    import threading

    def arm(seconds: float) -> None:
        timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGKILL if kind == "sigkill" else signal.SIGUSR2))
        timer.daemon = True
        timer.start()

    if kind == "raise":
        def fail(signum, frame):
            if not _in_training_step(frame):   # not training yet, or already handling an error: wait for a step
                arm(0.2)
                return
            from pipedream.errors import DataError
            raise DataError(f"injected fault on rank {rank}: the batch is malformed")
        signal.signal(signal.SIGUSR2, fail)
    arm(delay)


def _in_training_step(frame) -> bool:
    """Whether the main thread is inside an engine's ``train_step``, as a data error would be (a
    signal that lands while the rank connects, or handles another rank's failure, would raise from
    inside that handling instead)."""
    while frame is not None:
        if frame.f_code.co_name == "train_step":
            return True
        frame = frame.f_back
    return False


if os.environ.get("PROBE_LOG"):
    _record()
if os.environ.get("PROBE_FAULT") and "RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
    _who, _kind, _delay = os.environ["PROBE_FAULT"].split(":")
    if _who in ("all", os.environ["RANK"]):
        _inject(os.environ["RANK"], _kind, float(_delay))
