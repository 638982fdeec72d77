"""Maps an exception that ended a run to the one line a user sees (``error: ...`` on stderr).

Communication failures are recognised by type where torch gives one: NCCL raises
``DistBackendError`` (an error code or the watchdog's timeout), the store and sockets raise
``DistStoreError`` / ``DistNetworkError``, all subclasses of ``torch.distributed.DistError``. Gloo
raises a plain ``RuntimeError`` for a dead peer ("Connection closed by peer", "Connection reset by
peer") and for a receive past its timeout ("Timed out waiting ...", "Application timeout caused
pair closure"), so for Gloo the message is matched. Anything else keeps its type in the line; the
full traceback is printed with ``PIPEDREAM_DEBUG=1`` or ``train.debug=true``.
"""
from __future__ import annotations

import os
import time
import traceback

import torch
import torch.distributed as dist

from pipedream.checkpoint.store import CheckpointError
from pipedream.errors import ConfigError, DataError, InvariantError
from pipedream.numerics.optim import NonFiniteError

USER_ERRORS = (ConfigError, DataError, NonFiniteError, CheckpointError)   # the message says it all
AGREED_ERRORS = (NonFiniteError, CheckpointError)   # raised on every rank alike: rank 0's line says it
PEER_REPORT_WAIT_S = 5.0   # torchrun checks its ranks every 0.1 s (--monitor-interval) and stops the rest
GLOO_FAILURES = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "Timed out waiting",
                 "Application timeout caused pair closure")


def debug_requested(config_flag: bool = False) -> bool:
    return config_flag or os.environ.get("PIPEDREAM_DEBUG", "") not in ("", "0")


def is_communication_failure(error: BaseException) -> bool:
    if isinstance(error, dist.DistError):
        return True
    return type(error) is RuntimeError and any(marker in str(error) for marker in GLOO_FAILURES)


def failure_line(error: BaseException, rank: int, timeout_s: float) -> str:
    """The line (without traceback) that reports ``error`` on ``rank``."""
    first = _first_line(error)
    if isinstance(error, USER_ERRORS):
        return f"error: {first}"
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return (f"error: rank {rank}: out of memory ({type(error).__name__}: {first}): lower "
                f"train.micro_batch_size, use more pipeline stages (parallel.pp) or set recompute.granularity=full")
    if is_communication_failure(error):
        return (f"error: rank {rank}: communication failed (a peer died, or was silent longer than "
                f"train.timeout_s={timeout_s:g}): {first}")
    if isinstance(error, InvariantError):
        return (f"error: rank {rank}: internal error (InvariantError): {first}; please report it with the "
                f"traceback that PIPEDREAM_DEBUG=1 prints")
    return f"error: rank {rank}: {type(error).__name__}: {first}"


def failure_report(error: BaseException, rank: int, timeout_s: float, debug: bool) -> str:
    """``failure_line``, preceded by the traceback when debugging."""
    line = failure_line(error, rank, timeout_s)
    if not debug:
        return line
    return "".join(traceback.format_exception(error)) + line


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def wait_for_peer_report(error: BaseException) -> None:
    """Under torchrun, a rank whose peer died sees only "communication failed"; the peer has reported
    its own cause (or torchrun will: a killed rank), and torchrun stops this rank within moments. So
    wait a little before reporting: the user sees the cause, and this line only if nothing stops us."""
    if is_communication_failure(error) and os.environ.get("TORCHELASTIC_RUN_ID"):
        time.sleep(PEER_REPORT_WAIT_S)
