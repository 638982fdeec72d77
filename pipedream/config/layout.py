"""Where a rank sits in the (pipeline, data, context, tensor) grid, and the process groups that follow.

Ranks are ordered tensor-parallel fastest, then context-parallel, then data-parallel, then pipeline
(as Megatron-LM): rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank, so tensor- and
context-parallel peers are neighbours (same node) and pipeline stages are furthest apart. The
ranks that average their gradients at an update are a stage's dp x cp ranks: context-parallel
peers hold the same parameters and the same samples, each a part of every sequence.

``stage_replicas`` (PipeDream's 1F1B-RR) replaces the grid with one pipeline whose stage s runs on
``stage_replicas[s]`` consecutive ranks; micro-batch k visits replica k % stage_replicas[s]. There
is one data stream (``coords(rank).dp`` is 0); ``replica(rank)`` is the index within the stage.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from pipedream.config.balance import balanced_counts
from pipedream.errors import ConfigError
from pipedream.schedules.placement import PLACEMENTS, Placement
from pipedream.schedules.replicated import ReplicatedPipeline


class Coords(NamedTuple):
    pp: int
    dp: int
    tp: int
    cp: int = 0


@dataclass(frozen=True)
class ParallelLayout:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    vpp: int = 1
    cp: int = 1
    stage_replicas: tuple[int, ...] = ()
    placement: str = "round-robin"   # how chunks map to virtual stages (``schedules.placement``; zbv: "vshape")
    ep: int = 1                      # expert-parallel degree, taken from a stage's dp x cp ranks (world unchanged)

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"placement {self.placement!r} is unknown: choose one of {', '.join(PLACEMENTS)}")
        for name in ("pp", "dp", "tp", "vpp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel.{name} = {value!r} must be a positive integer")
        if self.stage_replicas:
            replicas = list(self.stage_replicas)
            if any(not isinstance(r, int) or isinstance(r, bool) or r < 1 for r in replicas):
                raise ConfigError(f"parallel.stage_replicas={replicas}: every stage needs a positive replica count")
            if len(replicas) != self.pp:
                raise ConfigError(f"parallel.stage_replicas={replicas} has {len(replicas)} entries but parallel.pp = "
                                  f"{self.pp}: set parallel.pp={len(replicas)} or give one count per stage")
            if (self.dp, self.tp, self.vpp, self.cp, self.ep) != (1, 1, 1, 1, 1):
                raise ConfigError(f"parallel.stage_replicas={replicas} replaces parallel.dp and needs tp = vpp = cp = 1 "
                                  f"(got dp={self.dp}, tp={self.tp}, vpp={self.vpp}, cp={self.cp}, ep={self.ep}): "
                                  f"set them to 1")
        if (self.dp * self.cp) % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} does not divide parallel.dp*cp={self.dp * self.cp} (expert-parallel "
                              f"ranks are taken from a stage's data- and context-parallel ranks): choose an ep "
                              f"dividing {self.dp * self.cp}")

    @property
    def world_size(self) -> int:
        if self.stage_replicas:
            return sum(self.stage_replicas)
        return self.pp * self.dp * self.cp * self.tp

    @property
    def num_virtual_stages(self) -> int:
        return self.pp * self.vpp

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        if self.stage_replicas:
            return Coords(self.replicated().stage_of(rank), 0, 0)
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        return Coords(rank // (self.tp * self.cp * self.dp), dp_rank, tp_rank, cp_rank)

    def degrees(self) -> str:
        """``pp=2 tp=2 dp=1`` (and ``cp=2`` when the sequence is split, ``ep=2`` when the experts are;
        replicated stages: their replica counts), for titles and launch lines."""
        if self.stage_replicas:
            return f"pp={self.pp} tp={self.tp} stage_replicas={list(self.stage_replicas)}"
        return (f"pp={self.pp} tp={self.tp}{f' cp={self.cp}' if self.cp > 1 else ''} dp={self.dp}"
                f"{f' ep={self.ep}' if self.ep > 1 else ''}")

    def rank_label(self, rank: int) -> str:
        """``rank 3 (pp 1, tp 1, dp 0)``: a rank with its coordinates (replicated stages: stage, replica)."""
        if self.stage_replicas:
            stage = self.replicated().stage_of(rank)
            return f"rank {rank} (stage {stage}, replica {rank - self.replicated().first_rank(stage)})"
        c = self.coords(rank)
        return f"rank {rank} (pp {c.pp}, tp {c.tp}{f', cp {c.cp}' if self.cp > 1 else ''}, dp {c.dp})"

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        """With ``stage_replicas``, ``dp_rank`` is the replica index within the stage."""
        if self.stage_replicas:
            return self.replicated().first_rank(pp_rank) + dp_rank
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def check_world_size(self, world_size: int) -> None:
        if self.stage_replicas and world_size != self.world_size:
            raise ConfigError(f"parallel.stage_replicas={list(self.stage_replicas)} sums to {self.world_size} ranks "
                              f"but WORLD_SIZE = {world_size}: make the replicas sum to {world_size} or launch "
                              f"{self.world_size} processes")
        if world_size != self.world_size:
            raise ConfigError(f"parallel.pp*tp*cp*dp = {self.pp}*{self.tp}*{self.cp}*{self.dp} = {self.world_size} but "
                              f"WORLD_SIZE = {world_size}: launch {self.world_size} processes "
                              f"(python -m launcher does) or change the degrees")

    @property
    def chunk_placement(self) -> Placement:
        """Which virtual stage each (pipeline rank, chunk) holds: round-robin, or a V (zbv)."""
        return Placement(self.pp, self.vpp, self.placement)

    def next_virtual_stage(self, pp_rank: int, chunk: int) -> tuple[int, int]:
        """(pp_rank, chunk) that consumes this chunk's output."""
        placement = self.chunk_placement
        return placement.stage_of(placement.virtual_stage(pp_rank, chunk) + 1)

    def prev_virtual_stage(self, pp_rank: int, chunk: int) -> tuple[int, int]:
        placement = self.chunk_placement
        return placement.stage_of(placement.virtual_stage(pp_rank, chunk) - 1)

    def virtual_stage(self, pp_rank: int, chunk: int) -> int:
        return self.chunk_placement.virtual_stage(pp_rank, chunk)

    def stage_of(self, virtual_stage: int) -> tuple[int, int]:
        """Inverse of ``virtual_stage``: (pp_rank, chunk)."""
        return self.chunk_placement.stage_of(virtual_stage)

    def peer_rank(self, rank: int, microbatch: int, chunk: int, forward: bool) -> int:
        """The rank that receives this rank's output of ``chunk`` (forward) or sends its input
        (backward) for ``microbatch``: the same data-parallel and tensor-parallel coordinates on the
        next/previous virtual stage (and context-parallel: the same part of the sequence), or with
        ``stage_replicas`` the replica that micro-batch visits."""
        coords = self.coords(rank)
        step = self.next_virtual_stage if forward else self.prev_virtual_stage
        pp_rank, _ = step(coords.pp, chunk)
        if self.stage_replicas:
            return self.replicated().route(pp_rank, microbatch)
        return self.rank_of(pp_rank, coords.dp, coords.tp, coords.cp)

    def p2p_channels(self) -> list[tuple[int, int]]:
        """Every (src, dst) pair of global ranks that may exchange activations or gradients, sorted;
        both directions of each pair. With ``stage_replicas``, the replica pairs that some
        micro-batch meets (``k % replicas`` on both sides)."""
        pairs: set[tuple[int, int]] = set()
        for rank in range(self.world_size):
            stage = self.coords(rank).pp
            if self.stage_replicas:
                if stage + 1 < self.pp:
                    period = math.lcm(self.stage_replicas[stage], self.stage_replicas[stage + 1])
                    pairs |= {(rank, self.peer_rank(rank, k, 0, True)) for k in range(period)
                              if self.replica(rank) == k % self.stage_replicas[stage]}
                continue
            for chunk in range(self.vpp):
                if self.virtual_stage(stage, chunk) + 1 < self.num_virtual_stages:
                    peer = self.peer_rank(rank, 0, chunk, True)
                    if peer != rank:   # the bottom of a V hands over without a message
                        pairs.add((rank, peer))
        return sorted(pairs | {(dst, src) for src, dst in pairs})

    def replicated(self) -> ReplicatedPipeline:
        """The pipeline as stage replica counts: ``stage_replicas``, or one replica per stage (each
        data-parallel pipeline on its own; its all-reduce spans the pipelines)."""
        return ReplicatedPipeline(self.stage_replicas or (1,) * self.pp)

    def stage_replica_count(self, pp_rank: int) -> int:
        """Ranks whose gradients one update of stage ``pp_rank`` averages (dp x cp of them)."""
        return self.stage_replicas[pp_rank] if self.stage_replicas else self.dp * self.cp

    def expert_groups(self, pp_rank: int, tp_rank: int) -> tuple[list[list[int]], list[list[int]]]:
        """(expert-parallel groups, expert-data-parallel groups) of one stage's tp slice: ep consecutive
        replicas (``replica``) exchange tokens; the dp*cp/ep replicas at the same place in their
        expert-parallel group hold the same experts and reduce their gradients together."""
        ranks = [self.rank_of(pp_rank, r // self.cp, tp_rank, r % self.cp) for r in range(self.dp * self.cp)]
        exchange = [ranks[start:start + self.ep] for start in range(0, len(ranks), self.ep)]
        return exchange, [ranks[offset::self.ep] for offset in range(self.ep)]

    def replica(self, rank: int) -> int:
        """This rank's index among the ranks whose gradients its stage's update averages."""
        if self.stage_replicas:
            return self.replicated().replica_of(rank)
        coords = self.coords(rank)
        return coords.dp * self.cp + coords.cp


def split_layers(num_layers: int, num_stages: int, layers_per_stage: list[int] | None = None,
                 layer_costs: Sequence[float] | None = None) -> list[tuple[int, int]]:
    """[start, end) layer ranges of each (virtual) stage: exactly ``layers_per_stage``; else with
    ``layer_costs`` (one per layer) the most balanced stages (``balance.balanced_counts``); else
    even by count (earlier stages take the remainder)."""
    if layers_per_stage is not None:
        if isinstance(layers_per_stage, (str, int, float, bool)) or not all(
                isinstance(c, int) and not isinstance(c, bool) for c in layers_per_stage):
            shown = layers_per_stage if isinstance(layers_per_stage, (str, int, float, bool)) else list(layers_per_stage)
            raise ConfigError(f"parallel.layers_per_stage={shown} must be a list of whole layer counts, one per "
                              f"(virtual) stage: e.g. [3,3], or null for stages of equal estimated cost")
        counts = list(layers_per_stage)
        if len(counts) != num_stages:
            raise ConfigError(f"parallel.layers_per_stage has {len(counts)} entries but there are {num_stages} "
                              f"(virtual) stages: give one count per stage")
        if any(c < 1 for c in counts):
            raise ConfigError(f"parallel.layers_per_stage={counts}: every stage needs at least one layer")
        if sum(counts) != num_layers:
            raise ConfigError(f"parallel.layers_per_stage={counts} sums to {sum(counts)} but the model has "
                              f"{num_layers} layers (embedding + blocks + head for GPT): make them sum to {num_layers}")
    else:
        if num_layers < num_stages:
            raise ConfigError(f"the model has {num_layers} layers, fewer than pp*vpp = {num_stages} (virtual) stages: "
                              f"lower parallel.pp or parallel.vpp, or add layers")
        if layer_costs is not None and len(layer_costs) == num_layers:
            counts = balanced_counts(layer_costs, num_stages)
        else:
            base, extra = divmod(num_layers, num_stages)
            counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds
