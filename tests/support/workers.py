"""Runs a function on N local processes joined by Gloo, with one thread each and a hard timeout,
so a hung or crashed rank fails the test instead of hanging the suite.

The processes are a pool kept for the whole test session: starting one (a Python that imports
torch, Hydra and this project) costs seconds of CPU, far more than most of the tiny runs the tests
give it. Worker ``i`` runs rank ``i`` of every call with at least ``i + 1`` ranks, in the test
process's environment, working directory and import path (``sys.path``) of the moment. After each
call a worker puts back what the call may have changed in its process and a new process would not
have: the signal handlers, the resource limits, the warning filters (and which warnings were
already shown), the default dtype, the global random state (torch's start-up seed) and
torch.compile's caches; it closes a process group the function left open. A call that fails or
times out ends the whole pool (a later call starts new processes), so no failure's state reaches
another test. A function that patches code (a class's method, say) puts it back before it returns
(try/finally); ``fresh=True`` gives a call processes of its own, for a function that changes what
cannot be put back."""
from __future__ import annotations

import importlib
import os
import pickle
import resource
import signal
import socket
import sys
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.multiprocessing as mp

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")


def _run_task(task: bytes, queue) -> None:
    rank, environ, cwd, path, call = pickle.loads(task)
    try:
        # the test process's environment, folder and import path as they are now, as a process
        # started now would have them (unpickling the call may import modules from that path)
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.path[:] = path
        importlib.invalidate_caches()
        fn, world_size, port, args = pickle.loads(call)
        os.environ.update(_rank_env(rank, world_size, port))
        # plain pickle copies tensor data; the queue's own pickler would pass shared-memory handles
        # that die with this process
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report any failure to the parent, which fails the test
        queue.put((rank, "error", traceback.format_exc()))
        raise


def _one_shot(task: bytes, queue) -> None:
    import torch
    torch.set_num_threads(1)
    _run_task(task, queue)


@dataclass
class _ProcessState:
    """What a call may change in a worker process that a new process would have as at start-up
    (the environment, the working directory and the import path come with each call)."""
    handlers: dict = field(default_factory=lambda: {s: signal.getsignal(s) for s in _catchable_signals()})
    limits: dict = field(default_factory=lambda: {r: resource.getrlimit(r) for r in _resource_limits()})
    warning_filters: list = field(default_factory=lambda: list(warnings.filters))
    path: list = field(default_factory=lambda: list(sys.path))

    def restore(self) -> None:
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for sig, handler in self.handlers.items():
            if signal.getsignal(sig) is not handler and handler is not None:
                signal.signal(sig, handler)
        for limit, value in self.limits.items():
            if resource.getrlimit(limit) != value:
                resource.setrlimit(limit, value)
        sys.path[:] = self.path
        warnings.resetwarnings()   # also forgets which warnings were shown "once"
        warnings.filters[:] = self.warning_filters
        torch.set_default_dtype(torch.float32)
        torch.set_num_threads(1)
        torch.manual_seed(torch.initial_seed())   # the seed every new process starts from
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].reset()


def _catchable_signals() -> list[signal.Signals]:
    return [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)
            and signal.getsignal(s) is not None]


def _resource_limits() -> list[int]:
    return [getattr(resource, name) for name in dir(resource) if name.startswith("RLIMIT_")]


def _pool_worker(tasks, queue) -> None:
    import torch
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    state = _ProcessState()
    while True:
        task = tasks.recv()
        if task is None:
            return
        _run_task(task, queue)
        state.restore()


@dataclass
class _Worker:
    process: Any
    tasks: Any   # the parent's end of the pipe the worker reads its calls from


class _Pool:
    """The session's worker processes, started as calls need them; ``close`` ends them all."""

    def __init__(self) -> None:
        self._context = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._queue = None

    def take(self, world_size: int) -> tuple[list[_Worker], Any]:
        if any(not w.process.is_alive() for w in self._workers):
            self.close()
        if self._queue is None:
            self._queue = self._context.Queue()
        while len(self._workers) < world_size:
            receive, send = self._context.Pipe(duplex=False)
            process = self._context.Process(target=_pool_worker, args=(receive, self._queue), daemon=True)
            process.start()
            receive.close()
            self._workers.append(_Worker(process, send))
        return self._workers[:world_size], self._queue

    def close(self, grace: float = 5.0) -> None:
        self.trim(0, grace)
        self._queue = None

    def trim(self, keep: int, grace: float = 5.0) -> None:
        """Ends the workers after the first ``keep``."""
        for worker in self._workers[keep:]:
            try:
                worker.tasks.send(None)
            except OSError:   # the worker is gone already
                pass
        _end(self._workers[keep:], grace)
        del self._workers[keep:]


def _end(workers: list[_Worker], grace: float) -> None:
    for worker in workers:
        worker.process.join(timeout=grace)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        worker.tasks.close()


KEPT = 4   # workers kept between calls: most tests run 2-4 ranks; the rare wider call starts the rest
_POOL = _Pool()   # one per test session (pytest's process); tests/conftest.py closes it at the end


def close_pool() -> None:
    _POOL.close()


def run_workers(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0, fresh: bool = False) -> list[Any]:
    """Returns fn's result of every rank; raises with the failing rank's traceback."""
    port = free_port()
    environ, cwd, path = dict(os.environ), os.getcwd(), list(sys.path)
    call = pickle.dumps((fn, world_size, port, args))
    tasks = [pickle.dumps((rank, environ, cwd, path, call)) for rank in range(world_size)]
    if fresh:
        context = mp.get_context("spawn")
        queue = context.Queue()
        workers = [_Worker(context.Process(target=_one_shot, args=(task, queue), daemon=True), None)
                   for task in tasks]
        for worker in workers:
            worker.process.start()
    else:
        workers, queue = _POOL.take(world_size)
        for worker, task in zip(workers, tasks):
            worker.tasks.send(task)
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
        if fresh:
            for worker in workers:
                worker.process.join(timeout=5 if not errors else 0.5)
                if worker.process.is_alive():
                    worker.process.kill()
        elif errors:
            _POOL.close(grace=0.5)
        else:
            _POOL.trim(KEPT)
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
