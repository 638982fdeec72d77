"""Everything a search needs, resolved once from the config: model, profile, cluster, batch, limits."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping

from pipedream.devices import GIB

from planner.inputs.hardware import Cluster
from planner.inputs.model_specs import ModelSpec
from planner.inputs.profile import Profile, analytic_profile
from planner.inputs.runtime_costs import NO_RUNTIME_COSTS, RuntimeCosts
from planner.inputs.memory_options import MemoryOptions


@dataclass(frozen=True)
class Inputs:
    model: str
    profile: Profile  # at tensor-parallel degree 1
    cluster: Cluster
    global_batch: int
    spec: ModelSpec | None = None  # analytic models can be re-profiled at any tensor-parallel degree
    reserve_gib: float = 3.0  # docs/planner.md, Memory reserve
    reserve_fraction: float = 0.2
    max_micro_batch: int = 32
    micro_batch: int | None = None  # fixed by the user; None = search
    schedules: tuple[str, ...] = ("1f1b", "interleaved", "gpipe")
    recompute: tuple[bool, ...] = (False, True)
    # memory savers (planner.inputs.memory_options.MemoryOptions; docs/planner.md, Memory savers)
    selective_recompute: bool = False   # also price recompute.granularity=selective
    sequence_parallel: bool = False     # take parallel.sequence_parallel at t > 1 where the model has it
    distributed_optimizer: bool = False  # take optim.distributed at d > 1 (flush schedules)
    grad_bucket_bytes: float | None = None  # train.overlap_grad_reduce's bucket size; None: blocking reduction
    recompute_layers: int | None = None  # recompute.num_layers: full/selective only the first k layers of a chunk
    max_zero: int = 3  # the deepest ZeRO level the search may take (with distributed_optimizer; docs/planner.md)
    context_parallel: bool = False  # search parallel.cp where the model allows it (family, dropout 0, seq_len)
    pin_cp: int | None = None  # fix the context-parallel degree (planner.cp)
    max_tp: int | None = None
    replication: bool = True
    memory_constraint: bool = True
    top_k: int = 4
    pin_tp: int | None = None  # fix the tensor-parallel degree (planner.tp)
    pin_pp: int | None = None  # fix the pipeline depth (planner.pp)
    pin_dp: int | None = None  # fix the data-parallel degree (planner.dp)
    fewer_devices: bool = True  # PipeDream DP: leave devices unused when more would not help
    pipedream_costs: str = "paper"  # paper | released (docs/planner.md, PipeDream's two cost models)
    activation_compression: float | None = 1.0  # released: boundaries' ratio; None = they cost nothing
    runtime: RuntimeCosts = NO_RUNTIME_COSTS  # cluster=measured: the runtime's own costs (planner.inputs.runtime_costs)
    tp_profiles: Mapping[int, Profile] = field(default_factory=lambda: MappingProxyType({}))  # measured at t > 1
    device_budget: float | None = None  # Harmony: bytes per device it may use (None: capacity less the reserve)
    harmony_costs: Mapping[int, Any] = field(default_factory=lambda: MappingProxyType({}))  # processes -> HarmonyOverheads
    harmony_alone_profile: Profile | None = None  # the layers timed alone around harmony_pp's calibration runs

    @property
    def capacity(self) -> float:
        return self.cluster.device.memory_bytes

    @property
    def workspace(self) -> float:
        """Bytes no plan may use: a fixed part (CUDA context, NCCL buffers, library workspaces) plus a
        fraction of the device (caching-allocator fragmentation, transient buffers the model omits)."""
        return memory_reserve(self.capacity, self.reserve_gib, self.reserve_fraction)

    def tp_degrees(self) -> list[int]:
        """Tensor-parallel degrees: divisors of n that the model splits into (whole heads) and align with nodes
        (t divides the devices per node or is a multiple of it, so no group straddles a node edge)."""
        if self.spec is None or self.spec.max_tp == 1:
            measured = [1, *sorted(self.tp_profiles)]  # a measured profile plans t > 1 only where calibrated
            return [t for t in measured if self.pin_tp in (None, t) and self.cluster.num_devices % t == 0]
        limit = min(self.spec.max_tp, self.max_tp or self.cluster.num_devices)
        per_node = self.cluster.devices_per_node
        if self.pin_tp is not None:
            return [self.pin_tp] if self.cluster.num_devices % self.pin_tp == 0 else []
        return [t for t in divisors(self.cluster.num_devices) if t <= limit and self.spec.allows_tp(t)
                and (per_node % t == 0 or t % per_node == 0)]

    def cp_degrees(self, ranks: int) -> list[int]:
        """Context-parallel degrees c for ``ranks`` = n / (t p) devices: divisors of it that cut the
        sequence into 2 c equal chunks (the zigzag layout), for a model that allows it; 1 otherwise."""
        seq = getattr(self.spec, "seq_len", None)
        if self.pin_cp is not None:
            return [self.pin_cp] if ranks % self.pin_cp == 0 else []
        if not self.context_parallel or not seq:
            return [1]
        return [c for c in divisors(ranks) if seq % (2 * c) == 0]

    def ep_degrees(self, ranks: int) -> list[int]:
        """Expert-parallel degrees for ``ranks`` = d c data- and context-parallel ranks: divisors of it
        that split the routed experts evenly; 1 for a dense model."""
        experts = self.profile.num_experts
        return [e for e in divisors(ranks) if experts % e == 0] if experts else [1]

    def as_in_the_dissertation(self) -> "Inputs":
        """Without the memory savers the dissertation's PTD-P did not have (selective recomputation,
        sequence parallelism, the distributed optimizer, overlapped reduction) and with its attention
        memory (the scores, softmax and dropout mask stored, as before fused attention kernels): its
        tables are reproduced so."""
        inputs = replace(self, selective_recompute=False, sequence_parallel=False, distributed_optimizer=False,
                         grad_bucket_bytes=None, recompute_layers=None, context_parallel=False)
        if getattr(self.spec, "fused_attention", False):
            spec = replace(self.spec, fused_attention=False)
            inputs = replace(inputs, spec=spec, profile=analytic_profile(spec, self.cluster.device, 1))
        return inputs

    def memory_options(self, t: int, d: int, selective: bool, profile: Profile,
                       distributed_optimizer: bool = False, partial_recompute: bool = True) -> MemoryOptions:
        """The memory savers a (t, d) configuration takes (PTD-P's flush schedules); without
        ``partial_recompute`` (the asynchronous schedules) recomputation covers every layer."""
        sequence_parallel = self.sequence_parallel and t > 1 and bool(profile.arrays["sequence_shardable_bytes"].any())
        shards = d if distributed_optimizer and self.distributed_optimizer and self.max_zero >= 1 and d > 1 else 1
        # the distributed optimizer's reduce-scatter overlaps the backward bucket by bucket, as the all-reduce does
        return MemoryOptions(selective=selective, sequence_parallel=sequence_parallel, optimizer_shards=shards,
                             grad_bucket_bytes=self.grad_bucket_bytes,
                             recompute_layers=self.recompute_layers if partial_recompute else None,
                             zero=1 if shards > 1 else 0)

    def profile_at(self, tp: int) -> Profile:
        if tp in self.tp_profiles:
            return self.tp_profiles[tp]
        if tp == 1 or self.spec is None:
            return self.profile
        return analytic_profile(self.spec, self.cluster.device, tp)

    def micro_batches(self, per_pipeline: int) -> list[int]:
        """Candidate micro-batch sizes for B / d samples per pipeline."""
        if self.micro_batch is not None:
            return [self.micro_batch] if per_pipeline % self.micro_batch == 0 else []
        return [b for b in divisors(per_pipeline) if b <= self.max_micro_batch]

    def model_flops(self, samples: float) -> float:
        """Model FLOPs: forward and backward (3 passes), the same for every plan."""
        return self.profile.flops_per_sample * samples

    def hardware_flops(self, samples: float, recompute: bool = True, selective: bool = False) -> float:
        """The FLOPs the devices execute: eq. 4.2's 4 passes (Table 4.1's count) where the forward is
        recomputed, the model's 3 without, plus the attention cores' forward again under selective
        recomputation. Counting a pass a plan does not run would claim work never done, above the
        device's peak for a plan near it (Harmony recomputes: the default)."""
        if recompute:
            return self.profile.flops_per_sample_recompute * samples
        again = float(self.profile.arrays["attention_core_flops"].sum()) if selective else 0.0
        return (self.profile.flops_per_sample + again) * samples


def memory_reserve(capacity: float, gib: float, fraction: float) -> float:
    return min(gib * GIB + fraction * capacity, capacity)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
