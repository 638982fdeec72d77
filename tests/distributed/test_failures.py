"""A dead or silent peer makes the surviving ranks fail with an error within train.timeout_s,
instead of hanging, and the error Gloo really raises is reported as a communication failure."""
from __future__ import annotations

import os
import time

import pytest

from tests.support.workers import run_workers
from tests.support.training_harness import TINY_GPT, compose_config


def _train_with_broken_rank(rank: int, world_size: int, mode: str, run_dir: str) -> str:
    from pipedream.runtime.distributed import init_distributed, shutdown
    from pipedream.lifecycle.failures import failure_line
    from pipedream.config.run_spec import build_run_spec
    from pipedream.runtime.stage import Stage
    from pipedream.trainer import train

    if rank == 1:
        original = Stage.forward
        calls = []

        def failing_forward(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 6:  # mid-iteration of the second step
                if mode == "die":
                    os._exit(1)
                time.sleep(3600)
            return original(self, *args, **kwargs)

        Stage.forward = failing_forward
    cfg = compose_config(TINY_GPT + ["train.steps=5", "parallel.pp=2", "train.timeout_s=5", f"train.run_dir={run_dir}"])
    ctx = init_distributed("cpu", 5)
    try:
        train(build_run_spec(cfg, world_size), ctx)
    except Exception as error:  # the line the entry point would print for the exception torch raised
        raise RuntimeError(f"{type(error).__name__} reported as: {failure_line(error, rank, 5)}") from error
    finally:
        shutdown()
    return "finished"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["die", "hang"])
def test_survivor_errors_out_within_the_timeout(tmp_path, mode):
    started = time.monotonic()
    with pytest.raises(AssertionError, match="rank 0 failed") as failure:
        run_workers(_train_with_broken_rank, 2, mode, str(tmp_path), timeout=60, fresh=True)
    assert time.monotonic() - started < 45
    assert "reported as: error: rank 0: communication failed (a peer died, or was silent longer than " \
           "train.timeout_s=5)" in str(failure.value)
