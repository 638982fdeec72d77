"""Runs a function on N local processes joined by Gloo, with one thread each and a hard timeout,
so a hung or crashed rank fails the test instead of hanging the suite."""
from __future__ import annotations

import os
import pickle
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(fn: Callable, rank: int, world_size: int, port: int, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    try:
        # plain pickle copies tensor data; the queue's own pickler would pass shared-memory handles
        # that die with this process
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report any failure to the parent, which fails the test
        queue.put((rank, "error", traceback.format_exc()))
        raise


def run_workers(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Returns fn's result of every rank; raises with the failing rank's traceback."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=_worker, args=(fn, rank, world_size, port, args, queue), daemon=True)
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    except Exception as error:  # queue.Empty on timeout
        errors.append(f"timed out after {timeout}s waiting for ranks {sorted(set(range(world_size)) - set(results))}"
                      f" ({type(error).__name__})")
    finally:
        for process in processes:
            process.join(timeout=5 if not errors else 0.5)
            if process.is_alive():
                process.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
