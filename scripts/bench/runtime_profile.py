"""Where a step's time goes, ours against torch.distributed.pipelining on one workload of
scripts/bench/runtime.py: both runtimes built in the same two processes and profiled in alternating
rounds (so both see the same machine), printing per rank the wall and main-thread CPU time per
step, the time spent inside Gloo's send/recv calls (posting a message), and cProfile's top
functions by own time.

Run: .venv/bin/python -m scripts.bench.runtime_profile --workload gpt --schedule 1f1b [--torch 1f1b]
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import os
import pstats
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scripts.bench.runtime_cases import PP, Case, workloads
from scripts.bench.runtime_steps import ours, theirs


def _time_posts(totals: dict, current: list[str]) -> None:
    """Adds the seconds each ProcessGroup send/recv call takes to totals[(case, call)]."""
    from torch.distributed import ProcessGroup

    for name in ("send", "recv"):
        call = getattr(ProcessGroup, name)

        def timed(self, *args, _call=call, _name=name, **kwargs):
            start = time.perf_counter()
            work = _call(self, *args, **kwargs)
            totals[(current[0], _name)] += time.perf_counter() - start
            return work
        setattr(ProcessGroup, name, timed)


def _worker(rank: int, port: int, args: argparse.Namespace, cores: list | None) -> None:
    if cores is not None:   # as the benchmark: each process on its own core, both runtimes alike
        os.sched_setaffinity(0, cores[rank])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=PP, timeout=datetime.timedelta(seconds=600))
    posts: dict = defaultdict(float)
    current = [""]
    _time_posts(posts, current)
    workload = next(w for w in workloads(False) if w.name == args.workload)
    steps = {"ours": ours(workload, Case("pipedream", args.schedule), rank, {}),
             "torch": theirs(workload, Case("torch", args.torch or args.schedule), rank)}
    for step in steps.values():
        step(), step()
    profiles = {name: cProfile.Profile() for name in steps}
    wall, cpu = defaultdict(float), defaultdict(float)
    for round_ in range(args.rounds):
        for name in (list(steps) if round_ % 2 == 0 else list(steps)[::-1]):
            dist.barrier()
            current[0], started, cpu_started = name, time.perf_counter(), time.thread_time()
            if args.cprofile:
                profiles[name].enable()
            for _ in range(args.block):
                steps[name]()
            if args.cprofile:
                profiles[name].disable()
            cpu[name] += time.thread_time() - cpu_started
            wall[name] += time.perf_counter() - started
    current[0] = ""
    n = args.rounds * args.block
    lines = []
    for name, profile in profiles.items():
        if not args.cprofile:
            lines.append(f"== rank {rank}, {name}: wall {wall[name] / n * 1e3:.1f} ms/step, main-thread CPU "
                         f"{cpu[name] / n * 1e3:.1f} ms/step, in send calls {posts[(name, 'send')] / n * 1e3:.2f} "
                         f"ms/step, in recv calls {posts[(name, 'recv')] / n * 1e3:.2f} ms/step (no cProfile)")
            continue
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats(args.sort).print_stats(args.top)
        body = text.getvalue().split("\n", 4)[-1]   # from the column header on
        lines += [f"== rank {rank}, {name}: wall {wall[name] / n * 1e3:.1f} ms/step, main-thread CPU "
                  f"{cpu[name] / n * 1e3:.1f} ms/step, in send calls {posts[(name, 'send')] / n * 1e3:.2f} ms/step, "
                  f"in recv calls {posts[(name, 'recv')] / n * 1e3:.2f} ms/step (cProfile's overhead included), "
                  f"{stats.total_calls / n:.0f} Python calls/step",
                  body.rstrip()]
    for turn in range(PP):   # one rank after the other, so the output does not interleave
        if turn == rank:
            print("\n".join(lines), flush=True)
        dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="gpt", choices=[w.name for w in workloads(False)])
    parser.add_argument("--schedule", default="1f1b", help="our schedule (as bench_runtime names it)")
    parser.add_argument("--torch", help="torch's schedule to compare with (default: the same name)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--block", type=int, default=2, help="steps per case and round")
    parser.add_argument("--top", type=int, default=25, help="functions listed per rank and runtime")
    parser.add_argument("--sort", default="tottime", choices=["tottime", "ncalls", "cumtime"],
                        help="order of the listed functions (cProfile column)")
    parser.add_argument("--no-cprofile", dest="cprofile", action="store_false",
                        help="time and CPU per step only, without cProfile's per-call overhead")
    parser.add_argument("--bind-cores", choices=("auto", "none"), default="auto",
                        help="auto: each process pinned to its own cores, as scripts.bench.runtime does")
    args = parser.parse_args(argv)
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    from scripts.bench.runtime import core_sets

    mp.start_processes(_worker, args=(port, args, core_sets(args.bind_cores == "auto")), nprocs=PP, join=True, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
