"""Measure this machine for the planner: ``python -m planner.calibrate model=gpt_tiny``.

Writes a cluster sheet (``planner.calibration_out``, schema in ``planner.inputs.cluster_sheet``) that
``cluster=measured cluster.calibration=<path>`` plans with. Measured, each as the median of repeats:

* per-layer forward and backward times of the model at ``planner.calibrate_micro_batches``, on
  ``planner.calibrate_threads`` threads as the trainer runs (``planner.calibrate.measure``), in every process
  of the node at once (as they contend in training; each on its own cores where there are enough, as
  the launcher binds training ranks, ``launcher.bind_cores``) and averaged over them;
* fp32 matmul FLOP/s and copy bandwidth of one process, and how much slower the same matmuls run
  while every process of the node computes at once (``matmul_slowdown_all_busy``, over 0.3 s
  windows so that more processes than cores show their time slicing; Harmony's estimator takes
  its compute slots and the layers timed alone from it; the layer profile is itself measured
  with every process computing, so ``compute_slowdown`` is 1);
* between two processes over Gloo: point-to-point one-way time vs message size (ping-pong) and
  all-reduce time vs size, each fitted as latency + bytes / bandwidth (``planner.calibrate.fit``:
  robust to one stalled size; where the times do not rise with the size the bandwidth is a stated
  bound, logged and kept in the sheet under ``method`` and ``note``);
* the optimizer step (gradient clipping, AdamW, zeroing) vs parameter bytes;
* the resident set of a process that has imported the runtime and joined the process group;
* the model's layers split two ways (tensor parallelism, ``TP_DEGREE``) over two of the processes,
  timed with the all-reduces inside them;
* the runtime's own costs from traced two-stage runs of the model, one per schedule family
  (``planner.calibrate.runtime``): per FWD/BWD action, per message, per step, and the resident set
  of a rank beyond its base and its model.

Re-running for another model keeps the sheet's other profiles. The other processes' share of the
CPU while it measured is recorded: on a shared machine every number carries that noise.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from planner.calibrate.harmony import measure_harmony, print_harmony
from planner.calibrate.runtime import check_as_launcher, measure_runtime, run_overrides
from planner.calibrate.fit import fit_latency_bandwidth
from planner.inputs.cluster_sheet import SCHEMA, model_fingerprint
from planner.errors import PlannerError
from planner.inputs.profile import mean_profile

# bytes; the smallest give the latency, the largest the bandwidth (below 4 KiB Gloo's back-to-back
# tiny messages stall on TCP acknowledgements, which a pipeline's activations never are); 16 MiB
# takes several ms over loopback, above a busy machine's scheduling stalls
MESSAGE_SIZES = (4096, 65536, 524288, 4194304, 16777216)
SMALL_MESSAGE = 65536   # sizes up to this are timed 4x as often (each round is short)
OPTIMIZER_SIZES = (65536, 524288, 2097152)         # parameters
TP_DEGREE = 2                                      # tensor-parallel layers measured at this degree


def _median_time(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops(seconds: float = 0.3, n: int = 256) -> float:
    """FLOP/s of back-to-back n x n matmuls over a window of ``seconds``: many scheduler time slices
    long, so processes time-sliced on shared cores show as slower (a few short timings can each
    fit in one slice and miss it)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - start)


def copy_bandwidth(repeats: int = 9, mib: int = 64) -> float:
    import torch

    src = torch.empty(mib * 2**18)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _median_time(lambda: dst.copy_(src), repeats)  # read + write


def optimizer_fit(repeats: int) -> dict[str, float]:
    """Seconds of one clip + AdamW (fused) + zero_grad step vs parameter bytes (fp32)."""
    import torch

    points = []
    for size in OPTIMIZER_SIZES:
        params = [torch.nn.Parameter(torch.randn(size // 4)) for _ in range(4)]
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

        def step():
            for p in params:
                p.grad = torch.ones_like(p)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        points.append((size * 4.0, _median_time(step, repeats)))
    fit = fit_latency_bandwidth(points, "optimizer step")
    return {"name": "adamw", "seconds_per_parameter_byte": 1.0 / fit.bandwidth, "step_overhead_s": fit.latency_s,
            "points": points, **{k: v for k, v in fit.to_json().items() if k in ("method", "note")}}


def _peak_rss() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return float(line.split()[1]) * 1024
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _ping_pong(buf, rank: int, repeats: int) -> float:
    """Median one-way time of ``buf`` between ranks 0 and 1, each round starting with both ends ready
    (as a scheduled send meets its posted receive)."""
    import torch.distributed as dist

    times = []
    for i in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        if i >= 2:
            times.append((time.perf_counter() - start) / 2)
    return statistics.median(times)


def _network_worker(rank: int, world: int, port: int, repeats: int, threads: int, out_dir: str,
                    model_cfg: dict, micro_batches: list[int]) -> None:
    """One of ``world`` processes: joins a Gloo group, then ping-pong, all-reduce, concurrent matmul
    and the model's layer profile while every other process profiles it too (as in training)."""
    from planner.calibrate.measure import measure_profile
    from pipedream.runtime.affinity import even_sets

    import torch
    import torch.distributed as dist

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= world:   # on its own cores, as the launcher binds a training rank (launcher.bind_cores=auto)
        os.sched_setaffinity(0, even_sets(cores, world)[rank])
    torch.set_num_threads(threads)
    import models  # noqa: F401  what a training process holds before its model
    import pipedream.trainer  # noqa: F401

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    base_rss = _peak_rss()
    p2p, allreduce = [], []
    for size in MESSAGE_SIZES:
        buf = torch.zeros(max(1, size // 4))
        reps = repeats * (4 if size <= SMALL_MESSAGE else 1)
        p2p.append((float(size), _ping_pong(buf, rank, reps)))
        dist.barrier()
        allreduce.append((float(size), _median_time(lambda: dist.all_reduce(buf), reps)))
    alone, concurrent = [], []
    for _ in range(max(3, repeats // 2)):  # paired rounds: both see the same phase of a shared machine
        dist.barrier()
        if rank == 0:
            alone.append(matmul_flops())  # the others wait in the barrier, using no CPU
        dist.barrier()
        concurrent.append(matmul_flops())  # every process computing at once
    dist.barrier()
    profile = measure_profile(model_cfg, micro_batches, "cpu", warmup=2, repeats=repeats).to_json()
    dist.barrier()
    profiles_tp = tensor_parallel_profiles(model_cfg, micro_batches, repeats, rank)
    result = {"p2p": p2p, "allreduce": allreduce, "base_rss": base_rss, "profile": profile, "profiles_tp": profiles_tp,
              "concurrent_flops": statistics.median(concurrent),
              "slowdown": statistics.median(a / c for a, c in zip(alone, concurrent)) if alone else 1.0}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def tensor_parallel_profiles(model_cfg: dict, micro_batches: list[int], repeats: int, rank: int) -> dict:
    """The model's layers split two ways over ranks 0 and 1 (the others idle), timed with their
    all-reduces; none if the model has no tensor-parallel split of 2."""
    import torch.distributed as dist

    from models import check_tensor_parallel_config
    from models.tensor_parallel import TensorParallel

    from planner.calibrate.measure import measure_profile

    try:
        check_tensor_parallel_config(model_cfg, TP_DEGREE)
    except Exception:  # noqa: BLE001 - the model does not split: plan it without tensor parallelism
        return {}
    group = dist.new_group(list(range(TP_DEGREE)))
    profile = None
    if rank < TP_DEGREE:
        context = TensorParallel(group=group, rank=rank, size=TP_DEGREE)
        profile = measure_profile(model_cfg, micro_batches, "cpu", warmup=2, repeats=repeats, tp=context).to_json()
    dist.barrier()
    return {str(TP_DEGREE): profile} if profile is not None else {}


def measure_network(processes: int, repeats: int, threads: int, model_cfg: dict,
                    micro_batches: list[int]) -> dict[str, Any]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_network_worker, args=(processes, port, repeats, threads, tmp, model_cfg, micro_batches),
                           nprocs=processes, join=True, start_method="spawn")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(processes)]
    rank0 = ranks[0]
    p2p = fit_latency_bandwidth(rank0["p2p"], "p2p one-way")
    allreduce = fit_latency_bandwidth(rank0["allreduce"], "all-reduce")
    steps = 2.0 * (processes - 1)
    return {"p2p": {**p2p.to_json(), "points": rank0["p2p"]},
            "allreduce": {**allreduce.to_json(), "latency_s": allreduce.latency_s / steps,
                          "bandwidth": allreduce.bandwidth * steps / processes, "group": processes,
                          "points": rank0["allreduce"]},
            "process_base_bytes": max(r["base_rss"] for r in ranks),
            "concurrent_flops": statistics.median(r["concurrent_flops"] for r in ranks),
            "slowdown": rank0["slowdown"], "profile": mean_profile([r["profile"] for r in ranks]),
            "profiles_tp": {t: mean_profile([r["profiles_tp"][t] for r in ranks[:int(t)]])
                            for t in rank0["profiles_tp"]}}


def _cpu_jiffies() -> tuple[int, int]:
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return 0, 0
    return sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0), sum(fields)


def _own_cpu_s() -> float:
    """CPU seconds of this process and of its finished workers (they are ours, not other load)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def calibrate(model_cfg: Any, micro_batches: Sequence[int], processes: int, threads: int, repeats: int,
              previous: dict | None = None, model_overrides: Sequence[str] | None = None) -> dict[str, Any]:
    """``model_overrides``: the Hydra overrides that select the model and its data, for the traced runs
    (None: none run)."""
    import torch

    from omegaconf import OmegaConf

    from planner.inputs.hardware import _total_ram_bytes

    torch.set_num_threads(threads)
    plain = OmegaConf.to_container(model_cfg, resolve=True) if not isinstance(model_cfg, dict) else model_cfg
    busy0, total0, own0 = *_cpu_jiffies(), _own_cpu_s()
    net = measure_network(processes, repeats, threads, plain, list(micro_batches))
    bandwidth = copy_bandwidth(repeats)
    data = {
        "schema": SCHEMA,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "threads": threads, "processes": processes, "cores": os.cpu_count(),
        "device": {"flops_fp32": net["concurrent_flops"], "memory_bytes": _total_ram_bytes(),
                   "memory_bandwidth": bandwidth,
                   # a swap copies a tensor into another: bytes moved per second, read + write counted once
                   "swap_bandwidth": bandwidth / 2},
        "p2p": net["p2p"], "allreduce": net["allreduce"], "optimizer": optimizer_fit(repeats),
        # the profile was measured with every process computing: already what training sees
        "compute_slowdown": 1.0, "matmul_slowdown_all_busy": net["slowdown"],
        "process_base_bytes": net["process_base_bytes"],
        "profiles": dict((previous or {}).get("profiles", {})),
    }
    busy1, total1 = _cpu_jiffies()
    ticks = os.sysconf("SC_CLK_TCK")
    own_cpu = _own_cpu_s() - own0
    other = max(0.0, (busy1 - busy0 - own_cpu * ticks) / (total1 - total0)) if total1 > total0 else None
    data["machine_load"] = {"other_cpu_share": other, "workers_excluded": True, "load_average": list(os.getloadavg())}
    label = plain.get("preset") or plain.get("name") or plain.get("_target_")   # a plugin: its target
    entry = {"model": str(label), "config": plain, "profile": net["profile"], "profiles_tp": net["profiles_tp"]}
    if model_overrides is not None:  # traced real runs: what the runtime spends beyond the layers
        entry["runtime"] = measure_runtime(model_overrides, net["profile"], data["optimizer"],
                                           data["process_base_bytes"])
        entry["runtime"]["harmony"] = measure_harmony(model_overrides, plain, data, list(micro_batches))
    data["profiles"][model_fingerprint(plain)] = entry
    return data


def main(argv: Sequence[str] | None = None) -> int:
    from planner.inputs.cluster_sheet import load_sheet
    from planner.calibrate.measure import trainable_config

    try:
        cfg = trainable_config(argv, "calibrate with")
        p = cfg.planner
        out = Path(str(p.calibration_out))
        previous = load_sheet(out) if out.exists() else None
        processes = int(cfg.cluster.get("devices_per_node", 2))
        if processes < 2:
            raise PlannerError(f"cluster.devices_per_node={processes}: calibration measures messages between "
                               f"processes; use at least 2")
        selected = run_overrides(sys.argv[1:] if argv is None else argv)   # the model and its data
        check_as_launcher(selected)
        overrides = selected if p.calibrate_runtime else None
        data = calibrate(cfg.model, list(p.calibrate_micro_batches), processes, int(p.calibrate_threads),
                         int(p.calibrate_repeats), previous, overrides)
    except (PlannerError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    for note in fit_notes(data):
        print(f"warning: {note}", file=sys.stderr)
    d, p2p, ar = data["device"], data["p2p"], data["allreduce"]
    print(f"wrote {out}: {d['flops_fp32'] / 1e9:.1f} GFLOP/s per process ({data['threads']} thread, all busy; "
          f"matmul x{data['matmul_slowdown_all_busy']:.2f} slower than alone), p2p {p2p['latency_s'] * 1e6:.0f} us + "
          f"{p2p['bandwidth'] / 1e9:.2f} GB/s, all-reduce step {ar['latency_s'] * 1e6:.0f} us + "
          f"{ar['bandwidth'] / 1e9:.2f} GB/s, optimizer {data['optimizer']['seconds_per_parameter_byte'] * 1e12:.0f}"
          f" ps/byte + {data['optimizer']['step_overhead_s'] * 1e6:.0f} us, process base "
          f"{data['process_base_bytes'] / 2**20:.0f} MiB; profiles: "
          f"{sorted(e['model'] for e in data['profiles'].values())}; other processes used "
          f"{(data['machine_load']['other_cpu_share'] or 0) * 100:.0f}% of the CPU meanwhile")
    runtime = next((e.get("runtime", {}) for e in data["profiles"].values() if e.get("config") == plain_model(cfg)), {})
    for family, cost in sorted((k, v) for k, v in runtime.items() if isinstance(v, dict) and "step_s" in v):
        update = f", {cost['update_s'] * 1e3:.2f} ms per update" if "update_s" in cost else ""
        print(f"  runtime ({family} run): {cost['compute_action_s'] * 1e6:.0f} us between actions per FWD/BWD "
              f"action, {cost['message_s'] * 1e6:.0f} us per message, {cost['step_s'] * 1e3:.2f} ms per step"
              f"{update}; traced layers x{cost.get('layer_time_ratio', float('nan')):.2f} the profile's")
    for family, reason in runtime.get("errors", {}).items():
        print(f"  runtime ({family} run) not measured: {reason}")
    print_harmony(runtime.get("harmony", {}))
    if "process_bytes" in runtime:
        print(f"  process beyond its base and its model: {runtime['process_bytes'] / 2**20:.0f} MiB")
    return 0


def fit_notes(data: dict) -> list[str]:
    """Why a fit of the sheet fell back to a bound (``planner.calibrate.fit``), one line each."""
    return [data[k]["note"] for k in ("p2p", "allreduce", "optimizer") if data[k].get("note")]


def plain_model(cfg: Any) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg.model, resolve=True)

