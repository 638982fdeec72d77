"""Peak FLOP/s of the device a rank runs on: the denominator of MFU.

CPUs have no data sheet we can trust (turbo, SMT, AVX width, the VM's share of the host), so the
peak is measured once by a matrix-multiply microbenchmark with the run's thread count and cached
in ``~/.cache/pipedream/peak_flops.json``, keyed by host, threads and torch version: later runs
(and every rank) read the cache instead of spending a second measuring. On CUDA the vendor sheet
(``pipedream.devices.DEVICES``) gives the peak for the precision training uses; an unknown GPU is
measured like a CPU.
"""
from __future__ import annotations

import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pipedream.devices import DEVICES
from pipedream.observe.host import cache_dir, cached_flops, cpu_model, write_cache

# substring of torch.cuda.get_device_name() -> pipedream.devices.DEVICES key
_CUDA_SHEETS = (("h200", "h200"), ("h100", "h100_80gb"), ("a100-sxm4-40gb", "a100_40gb"), ("a100", "a100_80gb"),
                ("v100", "v100_32gb"), ("1080 ti", "gtx_1080ti"))


@dataclass(frozen=True)
class PeakFlops:
    """``flops`` per second of one device; ``source`` says where the number comes from."""

    flops: float
    source: str           # "measured" | "cache" | "sheet:<name>"
    key: str
    precision: str = "fp32"


def cache_path() -> Path:
    return cache_dir() / "peak_flops.json"


def device_key(device: torch.device, threads: int) -> str:
    """What the measured peak depends on: the host, the device, the thread count, torch's kernels."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return f"{socket.gethostname()}|{device.type}:{name}|threads={threads}|torch={torch.__version__}"


def measure_matmul_flops(device: torch.device, n: int = 1024, seconds: float = 0.5, dtype=torch.float32) -> float:
    """Best-of-rounds FLOP/s of an n x n matmul (2 n^3 FLOPs); the best round is the least disturbed."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):  # warm-up: thread pool, caches, clocks
        torch.mm(a, b, out=out)
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        reps, start = 0, time.perf_counter()
        while reps < 4 or time.perf_counter() - start < 0.05:
            torch.mm(a, b, out=out)
            reps += 1
        sync()
        best = max(best, 2.0 * n**3 * reps / (time.perf_counter() - start))
    return best


def gpu_sheet(gpu_name: str) -> str | None:
    """The ``pipedream.devices.DEVICES`` key of a GPU named as ``torch.cuda.get_device_name`` names
    it (None for a GPU without a data sheet)."""
    name = gpu_name.lower()
    return next((sheet for pattern, sheet in _CUDA_SHEETS if pattern in name and sheet in DEVICES), None)


def _sheet_peak(device: torch.device, compute: str = "fp32") -> PeakFlops | None:
    """``compute``: the run's precision; bf16/fp16 take the sheet's tensor-core peak."""
    name = torch.cuda.get_device_name(device).lower()
    precision = compute if compute in ("bf16", "fp16") else "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    sheet = gpu_sheet(name)
    return None if sheet is None else PeakFlops(DEVICES[sheet].flops(precision), f"sheet:{sheet}", name, precision)


def peak_flops(device: torch.device, threads: int | None = None, path: Path | None = None,
               measure=measure_matmul_flops, precision: str = "fp32") -> PeakFlops:
    """The device's peak: sheet (known GPU, at the run's ``precision``), else cache, else measured
    (an fp32 GEMM) now and cached."""
    threads = threads or torch.get_num_threads()
    if device.type == "cuda":
        sheet = _sheet_peak(device, precision)
        if sheet is not None:
            return sheet
    key = device_key(device, threads)
    path = path or cache_path()
    cached = cached_flops(path, key)
    if cached is not None:
        return PeakFlops(cached, "cache", key)
    flops = measure(device)
    try:
        write_cache(path, key, flops)
    except OSError:  # read-only home: still usable, just measured again next time
        pass
    return PeakFlops(flops, "measured", key)


def as_dict(peak: PeakFlops) -> dict[str, object]:
    return asdict(peak)
