"""A priced configuration (``Candidate``) and what a search returns (``SearchResult``): the vocabulary
shared by every search (``planner.search``, ``planner.harmony``), the plan assembly and the report."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Candidate:
    algorithm: str
    pp: int
    tp: int
    dp: int
    vpp: int
    schedule: str
    micro: int
    num_microbatches: int
    global_batch: int
    recompute: bool
    stages: tuple[tuple[int, int, tuple[int, ...]], ...]  # per virtual stage: [start, end), ranks
    iteration_time: float
    samples_per_s: float
    tflops_per_device: float
    bubble_fraction: float
    memory_bytes: float
    capacity_bytes: float
    breakdown: dict[str, float] = field(default_factory=dict)
    why_lost: str = ""
    model_tflops_per_device: float = 0.0  # forward + backward only (3 passes), whatever is recomputed
    selective_recompute: bool = False    # recompute.granularity=selective (recompute is then False)
    sequence_parallel: bool = False      # parallel.sequence_parallel
    distributed_optimizer: bool = False  # optim.distributed (ZeRO level 1 or more)
    cp: int = 1                          # parallel.cp: each sequence split over cp ranks
    zero: int = 0                        # ZeRO level (optim.distributed: false, zero1, zero2, zero3)
    memory_parts: dict[str, float] = field(default_factory=dict)   # the fullest rank's bytes by part
    reshard_after_forward: bool = False  # optim.reshard_after_forward (ZeRO-3 fully sharded: layers whole only around their work)
    between_steps_bytes: float = 0.0     # the most model state a rank holds between steps (weights, gradients, optimizer)
    ep: int = 1                          # parallel.ep: MoE experts split over ep of the d*cp ranks

    @property
    def recompute_granularity(self) -> str:
        return "full" if self.recompute else "selective" if self.selective_recompute else "none"

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.capacity_bytes

    @property
    def key(self) -> tuple:
        return (self.pp, self.tp, self.dp, self.vpp, self.schedule, self.recompute_granularity, self.cp, self.zero,
                self.reshard_after_forward, self.ep)

    def describe(self) -> str:
        v = f" v={self.vpp}" if self.vpp > 1 else ""
        c = f" c={self.cp}" if self.cp > 1 else ""
        c += f" ep={self.ep}" if self.ep > 1 else ""
        z = f" zero{self.zero}" + (" reshard" if self.reshard_after_forward else "") if self.zero > 1 else ""
        rec = {"full": " recompute", "selective": " selective-recompute", "none": ""}[self.recompute_granularity]
        return f"(p={self.pp} t={self.tp}{c} d={self.dp}{v} b={self.micro} {self.schedule}{rec}{z})"


@dataclass(frozen=True)
class SearchResult:
    algorithm: str
    best: Candidate
    alternatives: tuple[Candidate, ...]
    considered: int
    notes: tuple[str, ...] = ()
