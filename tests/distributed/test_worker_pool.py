"""The Gloo worker pool (tests/support/workers.py): calls reuse its processes, each call finds a
process as a new one would have it (the test's environment, folder and import path; nothing the
previous call changed), and a failed call ends the pool so the next starts afresh."""
from __future__ import annotations

import os
import resource
import signal
import sys
import warnings

import pytest

from tests.support.workers import run_workers


def _state(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist

    return {"pid": os.getpid(), "rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"],
            "marker": os.environ.get("POOL_MARKER"), "cwd": os.getcwd(), "path": sys.path[0],
            "initialized": dist.is_initialized(), "usr1": signal.getsignal(signal.SIGUSR1),
            "fsize": resource.getrlimit(resource.RLIMIT_FSIZE), "filters": len(warnings.filters),
            "dtype": torch.get_default_dtype(), "draw": torch.rand(1).item()}


def _change_everything(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist

    before = _state(rank, world_size)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)   # left open on purpose
    total = torch.ones(1)
    dist.all_reduce(total)
    os.environ["POOL_MARKER"] = "left behind"
    os.chdir("/")
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    warnings.simplefilter("error")
    torch.set_default_dtype(torch.float64)
    torch.rand(5)
    return {**before, "total": total.item()}


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    return os.getpid()


@pytest.mark.slow
def test_calls_reuse_processes_that_look_new(tmp_path, monkeypatch):
    monkeypatch.setenv("POOL_MARKER", "from the test")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "modules"))
    first = run_workers(_change_everything, 2)
    assert [r["total"] for r in first] == [2.0, 2.0]
    assert [(r["rank"], r["world"], r["marker"], r["cwd"], r["path"]) for r in first] == \
           [(str(rank), "2", "from the test", str(tmp_path), str(tmp_path / "modules")) for rank in range(2)]
    again = run_workers(_state, 2)
    assert [r["pid"] for r in again] == [r["pid"] for r in first]   # the same processes
    for before, after in zip(first, again):
        assert {k: v for k, v in after.items() if k != "pid"} == \
               {k: v for k, v in before.items() if k not in ("pid", "total")}
    wider = run_workers(_state, 3)   # a third process joins the two
    assert [r["pid"] for r in wider[:2]] == [r["pid"] for r in first] and wider[2]["pid"] not in wider[:2]
    assert [r["world"] for r in wider] == ["3"] * 3


@pytest.mark.slow
def test_a_failed_call_ends_the_pool():
    before = run_workers(_state, 2)
    with pytest.raises(AssertionError, match="rank 1 failed:(.|\n)*rank 1 refuses"):
        run_workers(_fail_on_rank_one, 2)
    after = run_workers(_state, 2)
    assert not {r["pid"] for r in after} & {r["pid"] for r in before}
    assert [r["pid"] for r in run_workers(_state, 2)] == [r["pid"] for r in after]   # the new pool lives on
