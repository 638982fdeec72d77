"""Cost of equi-replicated pipelines (PTD-P, 2BW): p ranks x v chunks with equal block counts, each
replicated d times and split t ways. Shared by the searches (vectorised over micro-batch sizes) and
by the brute-force checks (one configuration at a time), so both read the same numbers.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pipedream.schedules import schedule_info
from planner.costs.all_to_all import alltoall_exposed, alltoall_seconds, ep_span  # noqa: F401 (their home before)

from planner.costs import closed_form as cost
from planner.inputs.cluster_sheet import optimizer_seconds
from planner.costs.collectives import allreduce_time
from planner.costs import fsdp
from planner.inputs.hardware import Cluster
from planner.inputs.model_specs import PRECISION_BYTES, LayerSpec
from planner.inputs.profile import Profile
from planner.inputs.memory_options import MemoryOptions
from planner.inputs.runtime_costs import NO_RUNTIME_COSTS, RuntimeCosts


def even_boundaries(profile: Profile, parts: int) -> np.ndarray | None:
    """Layer boundaries of ``parts`` virtual stages with equal numbers of blocks (ch. 4.2.2, 3.2.3).

    Layers before the first block (embedding) join the first stage, layers after the last (head) the
    last one. Models without blocks split all their layers evenly. None if the count does not divide.
    """
    kinds = [layer.kind for layer in profile.layers]
    units = [i for i, kind in enumerate(kinds) if kind == "block"] or list(range(len(kinds)))
    if parts < 1 or len(units) % parts:
        return None
    per = len(units) // parts
    return np.array([0] + [units[q * per] for q in range(1, parts)] + [len(kinds)], dtype=int)


def messages_per_microbatch(out_bytes: np.ndarray, in_bytes: np.ndarray) -> np.ndarray:
    """Sends and receives each rank posts per micro-batch: an output sent and its gradient received per
    outgoing boundary, an input received and its gradient sent per incoming one ((v, p) -> (p,))."""
    return 2.0 * ((np.asarray(out_bytes) > 0).sum(axis=0) + (np.asarray(in_bytes) > 0).sum(axis=0))


def _prefix(values: np.ndarray) -> np.ndarray:
    zeros = np.zeros(values.shape[:-1] + (1,))
    return np.concatenate([zeros, np.cumsum(values, axis=-1)], axis=-1)


@dataclass(frozen=True)
class RankStats:
    """Per micro-batch size (rows) and pipeline rank (columns), for one (t, p, v, recompute)."""

    micro_batches: np.ndarray  # (nb,)
    p: int
    v: int
    t: int
    recompute: bool
    forward: np.ndarray  # (nb, p) seconds of FWD per micro-batch (all chunks of the rank)
    backward: np.ndarray  # (nb, p) seconds of BWD, including the recomputed forward
    tp_comm: np.ndarray  # (nb, p) seconds of tensor-parallel all-reduces per micro-batch
    p2p_comm: np.ndarray  # (nb, p) seconds of sends (activations and gradients) per micro-batch
    param_bytes: np.ndarray  # (p,)
    optimizer_bytes: np.ndarray  # (p,)
    activation_bytes: np.ndarray  # (nb, p) kept per in-flight micro-batch
    working_bytes: np.ndarray  # (nb,) recompute working set
    chunk_forward: np.ndarray  # (nb, v, p) per chunk, for the simulator
    chunk_backward: np.ndarray
    boundary_bytes: np.ndarray  # (nb, v, p) output bytes each chunk sends on (0 for the last)
    messages: np.ndarray | None = None  # (p,) sends and receives each rank posts per micro-batch
    p2p_latency: float = 0.0  # the part of p2p_comm that is the messages' latency (2 v per micro-batch)
    options: MemoryOptions = field(default_factory=lambda: MemoryOptions())
    c: int = 1  # context-parallel degree: each rank holds 1/c of every sequence
    cp_comm: np.ndarray | None = None  # (nb, p) seconds of the context-parallel ring no attention block hides
    ep: int = 1  # expert-parallel degree: each rank holds 1/ep of every MoE block's routed experts
    expert_param_bytes: np.ndarray | None = None  # (p,) of param_bytes: the routed experts this rank holds
    expert_optimizer_bytes: np.ndarray | None = None  # (p,) their optimizer state, before any ZeRO sharding
    alltoall: tuple[np.ndarray, np.ndarray] | None = None  # (nb, p) seconds of the forward's and backward's all-to-alls
    layer_peak_bytes: np.ndarray | None = None  # (p,) parameter bytes of each rank's two largest layers
    layer_collectives: np.ndarray | None = None  # (nb, p) fully sharded ZeRO-3's exposed per-layer seconds per micro-batch
    fp32_per_byte: float = 2.0  # bytes of an fp32 gradient (or weight) shard per parameter byte

    @property
    def compute(self) -> np.ndarray:
        return self.forward + self.backward

    @property
    def ring(self) -> np.ndarray:
        return self.cp_comm if self.cp_comm is not None else np.zeros_like(self.forward)

    @property
    def per_microbatch(self) -> np.ndarray:
        return self.compute + self.tp_comm + self.p2p_comm + self.ring


def rank_stats(profile: Profile, cluster: Cluster, t: int, p: int, v: int, d: int, recompute: bool,
               micro_batches: np.ndarray, times: tuple[np.ndarray, np.ndarray] | None = None,
               options: MemoryOptions = MemoryOptions(), c: int = 1, ep: int = 1) -> RankStats | None:
    """Sum the profile's layers per rank for the even split; None if the blocks do not divide. Under
    context parallelism (``c`` > 1) a rank computes, keeps and sends a 1/c share of each sample's
    tokens, so its per-sample costs are those of b / c samples (``times``, where given, must be
    ``profile.times_many(micro_batches / c)``), plus the ring's exposed time. Under expert parallelism
    (``ep`` > 1) a rank holds 1/ep of the routed experts and its MoE blocks exchange tokens with
    all-to-alls (``alltoall_seconds``)."""
    bounds = even_boundaries(profile, p * v)
    if bounds is None:
        return None
    bs = np.asarray(micro_batches, dtype=float)
    share = bs / c   # samples' worth of tokens each rank handles per micro-batch
    fwd, bwd = times if times is not None else profile.times_many(share)
    col = profile.arrays
    first = _first_layers(bounds, options.recompute_layers)   # the layers recomputation applies to
    rec = col["recomputable"] & first

    def chunks(values: np.ndarray) -> np.ndarray:  # (..., N) -> (..., v, p) sums per virtual stage
        pre = _prefix(values)
        per = pre[..., bounds[1:]] - pre[..., bounds[:-1]]
        return per.reshape(per.shape[:-1] + (v, p))

    def ranks(values: np.ndarray) -> np.ndarray:
        return chunks(values).sum(axis=-2)

    c_fwd, c_bwd = chunks(fwd), chunks(bwd)
    if recompute:
        c_bwd = c_bwd + chunks(fwd * rec)  # the forward again before the backward (ch. 3.3.1)
    elif options.selective:   # the attention cores' share of each layer's forward, again
        core_share = np.divide(col["attention_core_flops"], col["flops"], out=np.zeros_like(col["flops"]),
                               where=col["flops"] > 0)
        c_bwd = c_bwd + chunks(fwd * core_share * first)
    tp_bytes = col["tp_forward_bytes"] + col["tp_backward_bytes"] + (col["tp_forward_bytes"] * rec if recompute else 0)
    tp_bw = cluster.bandwidth_for_span(t)
    tp_comm = np.outer(share, ranks(tp_bytes)) / tp_bw if t > 1 else np.zeros((len(bs), p))

    # Each chunk sends its output forward and its input gradient backward (ch. 4.2.2, 4.3.2).
    out_bytes = col["output_bytes"][bounds[1:] - 1].reshape(v, p).copy()
    out_bytes[-1, -1] = 0.0  # the last virtual stage sends nothing on
    in_bytes = np.concatenate([[0.0], col["output_bytes"][bounds[1:-1] - 1]]).reshape(v, p)
    sent = (out_bytes + in_bytes).sum(axis=0)  # per sample, per rank
    level = cluster.level_for_span(p * t * d * c)
    if p > 1:
        per_device = sent / t  # scatter/gather: b s h / t per device across nodes (ch. 4.4.1)
        gather = sent * (t - 1) / t / tp_bw if t > 1 else 0.0  # all-gather over the tensor-parallel group
        messages = 2 * v
        p2p = np.outer(share, per_device / level.bandwidth + gather) + messages * level.latency
    else:
        p2p = np.zeros((len(bs), p))

    kept, working = _kept_activations(col, rec, recompute, options, t, first)
    again = rec if recompute else (first & (col["attention_core_flops"] > 0)) if options.selective else None
    ring = ranks(ring_exposed(col, fwd, bwd, cluster, t, c, share, again)) if c > 1 else None
    params = col["parameter_bytes"] - col["expert_parameter_bytes"] * (1 - 1 / ep)
    experts, expert_opt = ranks(col["expert_parameter_bytes"]) / ep, ranks(col["expert_optimizer_bytes"]) / ep
    dense_opt = ranks(col["optimizer_bytes"] - col["expert_optimizer_bytes"])
    moe = bool(col["alltoall_bytes"].any())
    alltoall = tuple(ranks(x) for x in alltoall_seconds(col, cluster, t, c, ep, share, rec if recompute else None)) \
        if moe else None
    owner = np.repeat(np.arange(p * v) % p, np.diff(bounds))   # each layer's rank
    start, end = np.zeros(len(params), dtype=bool), np.zeros(len(params), dtype=bool)
    start[bounds[:-1]], end[bounds[1:] - 1] = True, True   # each chunk's first and last layers
    fsdp_exposed = fsdp.exposed_per_microbatch(
        fsdp.layer_collective_seconds(cluster, params, col["expert_parameter_bytes"] / ep, d * c, t, ep),
        fwd, bwd, start, end, rec if recompute else None) if d * c > 1 else np.zeros_like(fwd)
    return RankStats(
        micro_batches=bs, p=p, v=v, t=t, recompute=recompute,
        forward=c_fwd.sum(axis=-2), backward=c_bwd.sum(axis=-2), tp_comm=tp_comm, p2p_comm=p2p,
        param_bytes=ranks(params),
        optimizer_bytes=sharded_optimizer(dense_opt, expert_opt, options.optimizer_shards, ep),
        activation_bytes=np.outer(share, ranks(kept)), working_bytes=working * share,
        chunk_forward=c_fwd, chunk_backward=c_bwd,
        boundary_bytes=np.multiply.outer(share, out_bytes), messages=messages_per_microbatch(out_bytes, in_bytes),
        p2p_latency=2 * v * level.latency if p > 1 else 0.0, options=options, c=c, cp_comm=ring,
        ep=ep, expert_param_bytes=experts if moe else None,
        expert_optimizer_bytes=expert_opt if moe else None, alltoall=alltoall,
        layer_peak_bytes=fsdp.two_largest(params, owner, p), layer_collectives=ranks(fsdp_exposed),
        fp32_per_byte=4.0 / PRECISION_BYTES.get(profile.precision, 4))


def sharded_optimizer(dense: np.ndarray, experts: np.ndarray, shards: int, ep: int) -> np.ndarray:
    """A rank's optimizer state: ZeRO shards the dense part over the ``shards`` = d c ranks and the
    experts it holds over the d c / ep ranks holding the same ones."""
    return dense / shards + experts / max(1, shards // ep)


def reduction_seconds(stats: RankStats, cluster: Cluster, d: int, nbytes: np.ndarray | None = None) -> np.ndarray:
    """All-reduce seconds of ``nbytes`` (the stage's parameters by default; (..., p)) over the d c
    ranks; the routed experts' share reduces over the d c / ep ranks holding the same experts."""
    nbytes = stats.param_bytes if nbytes is None else nbytes
    group = d * stats.c
    if stats.ep == 1 or stats.expert_param_bytes is None:
        return allreduce_time(cluster, nbytes, group, stats.t)
    part = np.divide(stats.expert_param_bytes, stats.param_bytes, out=np.zeros_like(stats.param_bytes),
                     where=stats.param_bytes > 0)
    experts = nbytes * part
    return (allreduce_time(cluster, nbytes - experts, group, stats.t)
            + allreduce_time(cluster, experts, group // stats.ep, stats.t * stats.ep))


def ring_step_exposed(transfer, compute):
    """Seconds of one ring step that the attention block computed meanwhile does not hide."""
    return np.maximum(0.0, np.asarray(transfer) - np.asarray(compute))


def ring_exposed(col: dict[str, np.ndarray], fwd: np.ndarray, bwd: np.ndarray, cluster: Cluster, t: int, c: int,
                 share: np.ndarray, again: np.ndarray | None) -> np.ndarray:
    """(nb, N) exposed seconds of context parallelism's ring per micro-batch and layer. Each attention
    layer passes its K and V blocks (1/c of ``ring_bytes`` per sample) c - 1 times around the c ranks,
    each step overlapped with the attention block computed on the block already there (1/c of the
    rank's attention core); the backward carries dK and dV too (twice the bytes) beside the
    backward's blocks; a recomputed forward (``again``: the layers it covers) runs the ring again.
    The c ranks sit t apart, so the ring crosses the link of a t x c span."""
    level = cluster.level_for_span(t * c)
    step_bytes = np.outer(share, col["ring_bytes"]) / c
    core = np.divide(col["attention_core_flops"], col["flops"], out=np.zeros_like(col["flops"]), where=col["flops"] > 0)
    steps = (c - 1) * (col["ring_bytes"] > 0)
    forward = steps * ring_step_exposed(step_bytes / level.bandwidth + level.latency, fwd * core / c)
    backward = steps * ring_step_exposed(2 * step_bytes / level.bandwidth + level.latency, bwd * core / c)
    return forward + backward + (forward * again if again is not None else 0.0)


def _first_layers(bounds: np.ndarray, k: int | None) -> np.ndarray:
    """Per layer: whether it is among the first ``k`` of its chunk (all where k is None)."""
    position = np.concatenate([np.arange(end - start) for start, end in zip(bounds[:-1], bounds[1:])])
    return position < k if k is not None else np.ones(len(position), dtype=bool)


def kept_activation_bytes(layers: Sequence[LayerSpec], t: int, recompute: bool, options: MemoryOptions,
                          bounds: Sequence[tuple[int, int]]) -> np.ndarray:
    """Per layer (``layer_specs(t)``, per device and sample): what it keeps for its backward, as the
    search prices it; ``bounds`` are the run's chunks, whose first ``options.recompute_layers``
    layers recomputation applies to (the launcher's memory check)."""
    names = ("activation_bytes", "activation_bytes_recompute", "sequence_shardable_bytes", "attention_core_bytes")
    col = {name: np.array([getattr(layer, name) for layer in layers], dtype=float) for name in names}
    edges = np.array([start for start, _ in bounds] + [bounds[-1][1]]) if bounds else np.array([0, len(layers)])
    first = _first_layers(edges, options.recompute_layers)
    rec = np.array([layer.recomputable for layer in layers], dtype=bool) & first
    return _kept_activations(col, rec, recompute, options, t, first)[0]


def _kept_activations(col: dict[str, np.ndarray], rec: np.ndarray, recompute: bool, options: MemoryOptions,
                      t: int, first: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Bytes per sample each layer keeps for its backward, and the per-sample working set of a
    recomputation. Korthikanti et al. 2022: sequence parallelism divides the replicated part by t,
    selective recomputation drops the attention core (34sbh/t per layer with both); with full
    recomputation a layer keeps its input, itself sequence-sharded under sequence parallelism.
    ``rec`` marks the layers full recomputation applies to, ``first`` those selective applies to
    (recompute.num_layers)."""
    act = col["activation_bytes"]
    shardable = col["sequence_shardable_bytes"] if options.sequence_parallel else np.zeros_like(act)
    if recompute:
        kept_input = col["activation_bytes_recompute"] / np.where(shardable > 0, t, 1)
        kept = np.where(rec, kept_input, act - shardable + shardable / t)
        working = float((act - shardable + shardable / t)[rec].max()) if rec.any() else 0.0
        return kept, working
    kept = act - shardable + shardable / t
    if options.selective:
        cores = col["attention_core_bytes"] * (first if first is not None else 1.0)
        return kept - cores, float(cores.max())   # one layer's cores, rebuilt in its backward
    return kept, 0.0


def _buckets(param_bytes: np.ndarray, bucket: float) -> np.ndarray:
    return np.maximum(1, np.ceil(param_bytes / bucket)).astype(int)


def exposed_grad_sync(stats: RankStats, cluster: Cluster, d: int, compute: np.ndarray) -> np.ndarray:
    """(nb,) seconds of the data-parallel reduction after the flush that no backward hides. Blocking
    (no ``grad_bucket_bytes``): all of it. Overlapped: n = ceil(params / bucket) equal buckets become
    ready evenly over the last micro-batch's backward B and go one at a time, so a rank waits for
    max(R/n, R - B (1 - 1/n)) of its reduction R: the last bucket's, or what the chain started
    after the first 1/n of B leaves over (the simulator's ``Costs.grad_reduce`` model; the backward
    being its share of the forward-plus-backward ``compute``)."""
    per_rank = reduction_seconds(stats, cluster, d)   # (p,): over the d x c ranks
    bucket = stats.options.grad_bucket_bytes
    if bucket is None:
        return np.full(len(stats.micro_batches), float(per_rank.max()))
    reduce, gather = _reduce_and_gather(stats, per_rank)
    share = 1.0 / _buckets(stats.param_bytes, bucket)   # 1/n
    scale = 1.0 if compute is None else compute / np.maximum(stats.compute, 1e-30)
    return (_exposed(reduce, share, stats.backward * scale).max(axis=1)
            + _exposed(gather, share, stats.forward * scale).max(axis=1))


def _exposed(seconds: np.ndarray, share: np.ndarray, hiding: np.ndarray) -> np.ndarray:
    """(nb, p) of a collective of ``seconds`` per rank in n equal buckets (``share`` = 1/n) chained
    beside ``hiding`` seconds of compute that the buckets become ready for (or are needed by)
    evenly: the last bucket's time, or what the chain leaves over beyond the compute after the
    first 1/n."""
    return np.maximum((seconds * share)[None, :], seconds[None, :] - hiding * (1.0 - share[None, :]))


def _reduce_and_gather(stats: RankStats, allreduce: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each rank's reduction that the backward can hide, and its parameter all-gather that the next
    step's first forward can hide (the distributed optimizer: the all-reduce's time is its
    reduce-scatter and its all-gather, half each; bucket by bucket, each layer waiting for its own)."""
    if stats.options.optimizer_shards > 1:
        return allreduce / 2, allreduce / 2
    return allreduce, np.zeros_like(allreduce)


@dataclass(frozen=True)
class OverlappedReduction:
    """The data-parallel reduction overlapping the backward, as the simulator takes it
    (``Costs.grad_reduce``): per rank, each of its v chunks' seconds (an even share) and buckets,
    and the planner's exposed seconds for the same micro-batch row."""

    seconds: np.ndarray   # (p,) per chunk
    buckets: np.ndarray   # (p,) per chunk
    exposed: float
    after: float = 0.0    # exposed seconds of the distributed optimizer's all-gather (charged at the sync)


def overlapped_reduction(stats: RankStats, cluster: Cluster, d: int, row: int = 0) -> OverlappedReduction | None:
    """None where the reduction blocks (no ``grad_bucket_bytes``), there is none (d = 1) or it runs per
    layer and micro-batch (fully sharded ZeRO-3, priced in the stage time)."""
    bucket = stats.options.grad_bucket_bytes
    if bucket is None or d * stats.c <= 1 or resharded(stats):
        return None
    per_rank, gather = _reduce_and_gather(stats, reduction_seconds(stats, cluster, d))
    buckets = _buckets(stats.param_bytes / stats.v, bucket)
    after = float(_exposed(gather, 1.0 / _buckets(stats.param_bytes, bucket), stats.forward)[row].max())
    return OverlappedReduction(per_rank / stats.v, buckets, float(exposed_grad_sync(stats, cluster, d, None)[row]),
                               after)


@dataclass(frozen=True)
class Estimates:
    """One value per micro-batch size of a RankStats (arrays (nb,)); ``valid`` marks usable rows."""

    valid: np.ndarray
    microbatches: np.ndarray  # m per pipeline
    iteration_time: np.ndarray
    memory: np.ndarray  # max over ranks, bytes per device
    bubble: np.ndarray
    compute: np.ndarray  # seconds per iteration of each part, at the slowest rank
    tp_comm: np.ndarray
    p2p_comm: np.ndarray
    bubble_time: np.ndarray
    dp_comm: np.ndarray
    cp_comm: np.ndarray | None = None  # the context-parallel ring's exposed seconds per iteration
    parts: dict[str, np.ndarray] | None = None  # the fullest rank's memory by part (MEMORY_PARTS), bytes
    between_steps: np.ndarray | None = None  # the most model state (weights, gradients, optimizer) a rank holds between steps
    ep_comm: np.ndarray | None = None  # the MoE all-to-alls' exposed seconds per iteration


def estimate(stats: RankStats, cluster: Cluster, schedule: str, d: int, global_batch: int,
             workspace: float, runtime: RuntimeCosts = NO_RUNTIME_COSTS) -> Estimates:
    """Iteration time and peak memory for every micro-batch size of ``stats`` under ``schedule``;
    ``runtime`` adds what the calibrated runtime spends per action, message and step beyond the layers."""
    bs, p, v = stats.micro_batches, stats.p, stats.v
    per_pipeline = global_batch / d
    m = per_pipeline / bs
    valid = (np.abs(m - np.round(m)) < 1e-9) & (m >= 1)
    m = np.where(valid, np.round(m), 1.0)
    info = schedule_info(schedule)
    # the sizes the schedule accepts (interleaved: m divisible by p; 2bw: m >= p, ch. 3.2.1); v > 1 only
    # for an interleaving one (the V schedules are priced as one stage per rank)
    valid &= info.accepts(p, m, info.chunks(v)) & (info.interleaves == (v > 1))
    two_bw = info.asynchronous and not info.updates_per_microbatch   # no flush, one update per batch

    overheads = runtime.for_schedule(schedule)
    messages = stats.messages if stats.messages is not None else np.zeros(p)
    runtime_per_mb = overheads.per_microbatch(2.0 * v, messages)  # (p,): a FWD and a BWD per chunk
    # measured runtime costs (planner.inputs.runtime_costs): the layers at their traced pace, and a message
    # costs its traced send or receive, which holds its transfer (no fitted latency on top)
    compute = stats.compute * overheads.layer_time_ratio
    p2p = stats.p2p_comm - (stats.p2p_latency if runtime.measured else 0.0)
    alltoall = alltoall_exposed(stats, schedule, overheads.layer_time_ratio)   # (nb, p): MoE blocks' exchanges
    per_mb = compute + stats.tp_comm + p2p + stats.ring + alltoall + runtime_per_mb[None, :]  # (nb, p)
    gathers = zero3_layer_seconds(stats, d)   # (nb, p): fully sharded ZeRO-3's per-layer collectives
    per_mb = per_mb + gathers
    slow = per_mb.argmax(axis=1)
    rows = np.arange(len(bs))
    stage_time = per_mb[rows, slow]
    group = d * stats.c   # gradients reduce over the data- and context-parallel ranks together
    grad_sync = float(reduction_seconds(stats, cluster, d).max()) if group > 1 else 0.0
    shards = stats.options.optimizer_shards   # the distributed optimizer updates 1/d of the parameters
    update = float(optimizer_seconds(cluster, stats.param_bytes / shards).max()) + overheads.step_s  # 0 unless measured
    if two_bw:
        # ch. 3.3.3 THROUGHPUT(.): a micro-batch every max_i max(comp_i + comm_i, allreduce_i / m) seconds
        every = np.maximum(stage_time, grad_sync / m)
        iteration = every * m + update
        bubble = np.zeros_like(bs)
        dp_comm = iteration - stage_time * m
        bubble_time = np.zeros_like(bs)
    else:
        bubble = cost.bubble_fraction(schedule, p, m, v)
        # fully sharded ZeRO-3 reduce-scatters per layer and micro-batch: nothing is left for the flush
        grad_sync = exposed_grad_sync(stats, cluster, d, compute) if group > 1 and not resharded(stats) \
            else np.zeros_like(bs)
        grad_sync = grad_sync + zero3_gather_seconds(stats, cluster, d)
        iteration = cost.flush_iteration_time(schedule, stage_time, p, m, v) + grad_sync + update
        bubble_time = stage_time * m * bubble
        dp_comm = grad_sync + update + gathers[rows, slow] * m  # the optimizer step counted with the gradient sync

    memory, parts = peak_memory(stats, schedule, m, workspace, runtime.process_bytes)
    return Estimates(valid, m, iteration, memory, bubble, (compute[rows, slow] + runtime_per_mb[slow]) * m,
                     stats.tp_comm[rows, slow] * m, p2p[rows, slow] * m, bubble_time, dp_comm,
                     stats.ring[rows, slow] * m, parts, np.full(len(bs), between_steps_memory(stats, schedule)),
                     alltoall[rows, slow] * m)


def peak_memory(stats: RankStats, schedule: str, m: np.ndarray, workspace: float,
                process_bytes: float = 0.0) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(nb,) bytes of the fullest rank at ``m`` micro-batches per pipeline, and that rank's bytes by part
    (weights, gradients, optimizer state, activations with the recompute working set).

    The ZeRO levels as the runtime holds them at the peak (``MemoryOptions``): every level keeps the
    stage's whole gradients during the step (the micro-batches accumulate into them) and level 1 and
    up 1/(d c) of the optimizer state; the parameters are whole at every level, since ZeRO-3 gathers
    them at the stage's first forward and frees them after its last backward. So ZeRO-2 and ZeRO-3
    peak where ZeRO-1 does; they save between steps (``between_steps_memory``). ZeRO-3 with
    ``reshard_after_forward`` is the exception (``sharded_peak``)."""
    p, v = stats.p, stats.v
    flight = cost.in_flight(schedule, p, np.arange(p)[None, :], m[:, None], v)
    versions = cost.weight_versions(schedule)
    weights, grads = sharded_peak(stats, schedule) if resharded(stats) else (stats.param_bytes, stats.param_bytes)
    activations = stats.activation_bytes * flight + stats.working_bytes[:, None]
    per_rank = cost.device_memory(weights[None, :], stats.optimizer_bytes[None, :], versions, activations, 1.0,
                                  0.0, workspace, grads[None, :])
    full = per_rank.argmax(axis=1)
    rows = np.arange(len(m))
    parts = {"weights": weights[full] * versions, "gradients": grads[full], "optimizer": stats.optimizer_bytes[full],
             "activations": activations[rows, full]}
    return per_rank[rows, full] + process_bytes, parts


def resharded(stats: RankStats) -> bool:
    """ZeRO-3 with ``reshard_after_forward``: each layer whole only around its own work."""
    return stats.options.zero >= 3 and stats.options.reshard_after_forward


def sharded_peak(stats: RankStats, schedule: str) -> tuple[np.ndarray, np.ndarray]:
    """(p,) weight and gradient bytes a rank holds at its peak under ZeRO-3 with
    ``reshard_after_forward``: its 1/(d c) fp32 gradient shard (and, in fp32, its weight shard, the
    master copy that mixed precision counts with the optimizer state) plus about two layers whole
    (the one working and the next one's prefetch or the last one's reduce-scatter: the rank's two
    largest; full recomputation checkpoints each layer on its own, so its recomputation adds nothing
    whole beyond the layer recomputed); a split backward (zb_h2, zbv, dualpipev) keeps each layer whole from its B to its
    deferred W, so the whole stage is counted, as without resharding."""
    shard = stats.param_bytes * stats.fp32_per_byte / stats.options.optimizer_shards
    master = shard if stats.fp32_per_byte <= 1 else 0.0
    if schedule_info(schedule).split_backward or stats.layer_peak_bytes is None:
        return stats.param_bytes + master, stats.param_bytes + shard
    whole = stats.layer_peak_bytes
    return whole + master, whole + shard


def between_steps_memory(stats: RankStats, schedule: str) -> float:
    """Bytes of model state (weights, gradients, optimizer state) the fullest rank holds between
    steps, when no activation is kept: levels 0 and 1 keep whole weights and gradients, level 2 drops
    the gradients, level 3 keeps only its 1/(d c) shard of the weights (the optimizer state as in
    ``stats``, sharded from level 1)."""
    zero, shards = stats.options.zero, stats.options.optimizer_shards
    weights = stats.param_bytes * cost.weight_versions(schedule) / (shards if zero >= 3 else 1)
    grads = stats.param_bytes if zero <= 1 else 0.0
    return float((weights + grads + stats.optimizer_bytes).max())


def zero3_gather_seconds(stats: RankStats, cluster: Cluster, d: int) -> float:
    """ZeRO-3's extra all-gather of the stage's parameters before the first forward of a step (half
    an all-reduce's time over the d x c ranks), which nothing hides; 0 below level 3, and with
    ``reshard_after_forward``, whose gathers come with every layer (``zero3_layer_seconds``)."""
    if stats.options.zero < 3 or resharded(stats) or d * stats.c <= 1:
        return 0.0
    return float(reduction_seconds(stats, cluster, d).max()) / 2


def zero3_layer_seconds(stats: RankStats, d: int) -> np.ndarray:
    """(nb, p) seconds per micro-batch that ZeRO-3 with ``reshard_after_forward`` spends on its
    per-layer collectives beyond the compute that hides them (``fsdp.exposed_per_microbatch``: two
    gathers and a reduce-scatter of each layer, a third gather with recomputation); zeros otherwise."""
    if not resharded(stats) or d * stats.c <= 1 or stats.layer_collectives is None:
        return np.zeros_like(stats.forward)
    return stats.layer_collectives
