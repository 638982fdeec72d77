"""Process-group start-up from torchrun's environment, with timeouts so no rank waits forever."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pipedream.config.elastic import WORLD_ROUND
from pipedream.errors import ConfigError


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    timeout: timedelta


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def choose_device(preference: str, local_rank: int) -> torch.device:
    """``cpu``, ``cuda``, or ``auto`` (CUDA when available)."""
    if preference not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"cluster.device={preference!r} is unknown: use cpu, cuda or auto")
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError("cluster.device=cuda but no CUDA device is visible: use cluster=local_cpu")
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(device_preference: str, timeout_s: float) -> DistContext:
    """Joins the job started by torchrun, or forms a world of one without it."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = world_size_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = choose_device(device_preference, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=float(timeout_s))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
            # torchrun keeps its store across restarts: a restarted job must not read the addresses
            # that the previous attempt's (dead) ranks published, so each attempt gets its own keys
            # (an elastic world's nodes may have restarted different numbers of times: the launch agent
            # passes the rendezvous round, the same on every node)
            attempt = os.environ.get(WORLD_ROUND) or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"pipedream/attempt_{attempt}", store)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistContext(rank, world_size, local_rank, device, backend, timeout)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
