"""Process groups for a layout: a DeviceMesh over (pp, dp, cp, tp), the groups that join stages
holding copies of a tied parameter, and two groups for point-to-point messages (one per
direction). ``dp`` is always the group whose gradients one update averages: the data-parallel and
context-parallel ranks of a stage together (one reduction over both, as Megatron-LM's), and with
``stage_replicas`` (1F1B-RR, no grid) this rank's stage replicas."""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from models.spec import LayerModel

from pipedream.config.layout import ParallelLayout


@dataclass(frozen=True)
class DirectedGroups:
    """Point-to-point messages travel on two groups of every rank: one carries each message to a
    higher rank, the other each message to a lower one. NCCL runs the calls between two ranks of
    one group in order on one stream, and a send may wait for its receive; with both directions on
    one stream, a receive posted ahead of the send its peer waits for hangs both ranks
    (``stream_model`` shows it for every schedule). One direction per group cannot."""

    to_higher: dist.ProcessGroup
    to_lower: dist.ProcessGroup

    def carrying(self, src: int, dst: int) -> dist.ProcessGroup:
        return self.to_higher if src < dst else self.to_lower


@dataclass
class ProcessGroups:
    mesh: DeviceMesh | None                # None with stage_replicas (no grid)
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup                  # ranks averaging this stage's gradients: dp x cp (or the replicas)
    tp: dist.ProcessGroup | None
    tied: list[dist.ProcessGroup | None]   # per model.tied group: mine, or None if not split
    p2p: DirectedGroups | None = None      # None when pp = 1
    cp: dist.ProcessGroup | None = None    # ranks holding the parts of the same sequences (cp > 1)
    ep: dist.ProcessGroup | None = None    # ranks of a stage exchanging tokens with their experts (ep > 1)
    expert_dp: dist.ProcessGroup | None = None   # ranks holding my experts: they reduce their gradients (ep > 1)
    ep_backward: dist.ProcessGroup | None = None   # ep's ranks again, for the backwards' exchanges (ep_overlap)


def build_p2p_groups(layout: ParallelLayout) -> DirectedGroups | None:
    """Every rank calls this (new_group is collective), in the same order."""
    if layout.pp == 1:
        return None
    return DirectedGroups(to_higher=dist.new_group(), to_lower=dist.new_group())


def layer_owner(layout: ParallelLayout, bounds: list[tuple[int, int]], layer: int) -> int:
    """The pipeline rank that holds ``layer``."""
    for virtual_stage, (start, end) in enumerate(bounds):
        if start <= layer < end:
            return layout.stage_of(virtual_stage)[0]
    raise ValueError(f"layer {layer} is in no stage")


def build_replicated_groups(layout: ParallelLayout, rank: int, model: LayerModel) -> ProcessGroups:
    """Stage-replica groups for 1F1B-RR; every rank creates every group, in order, as new_group requires.
    Tied parameters across stages are rejected for the asynchronous schedules (run_spec)."""
    topology = layout.replicated()
    mine = None
    for stage in range(topology.pp):
        created = dist.new_group(list(topology.ranks(stage)))
        if stage == topology.stage_of(rank):
            mine = created
    return ProcessGroups(mesh=None, pp=dist.group.WORLD, dp=mine, tp=None, tied=[None] * len(model.tied),
                         p2p=build_p2p_groups(layout))


def build_groups(layout: ParallelLayout, rank: int, device_type: str, model: LayerModel,
                 bounds: list[tuple[int, int]], ep_backward: bool = False) -> ProcessGroups:
    """``ep_backward``: also a second expert-parallel group for the exchanges of backwards
    (``ExpertParallel.backward_group``)."""
    if layout.stage_replicas:
        return build_replicated_groups(layout, rank, model)
    mesh = init_device_mesh(device_type, (layout.pp, layout.dp, layout.cp, layout.tp),
                            mesh_dim_names=("pp", "dp", "cp", "tp"))
    me = layout.coords(rank)
    tied: list[dist.ProcessGroup | None] = []
    for group in model.tied:
        pp_ranks = sorted({layer_owner(layout, bounds, layer) for layer, _ in group})
        mine = None
        if len(pp_ranks) > 1:
            # every rank creates every group, in the same order, as new_group requires
            for dp_rank in range(layout.dp):
                for cp_rank in range(layout.cp):
                    for tp_rank in range(layout.tp):
                        ranks = [layout.rank_of(p, dp_rank, tp_rank, cp_rank) for p in pp_ranks]
                        created = dist.new_group(ranks)
                        if (me.dp, me.cp, me.tp) == (dp_rank, cp_rank, tp_rank) and me.pp in pp_ranks:
                            mine = created
        tied.append(mine)
    ep, expert_dp, ep_back = build_expert_groups(layout, rank, ep_backward)
    return ProcessGroups(mesh=mesh, pp=mesh.get_group("pp"), dp=gradient_group(layout, mesh), tp=mesh.get_group("tp"),
                         cp=mesh.get_group("cp") if layout.cp > 1 else None, tied=tied, p2p=build_p2p_groups(layout),
                         ep=ep, expert_dp=expert_dp, ep_backward=ep_back)


def build_expert_groups(layout: ParallelLayout, rank: int, ep_backward: bool = False
                        ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(expert-parallel, expert-data-parallel, with ``ep_backward`` the backwards' expert-parallel)
    groups of this rank (``ParallelLayout.expert_groups``), None at ep = 1; every rank creates every
    group, in the same order, as new_group requires."""
    if layout.ep == 1:
        return None, None, None
    mine: dict[str, dist.ProcessGroup] = {}
    for pp_rank in range(layout.pp):
        for tp_rank in range(layout.tp):
            exchange, same_experts = layout.expert_groups(pp_rank, tp_rank)
            kinds = [("ep", exchange), ("expert_dp", same_experts)] + ([("ep_backward", exchange)] if ep_backward else [])
            for kind, lists in kinds:
                for ranks in lists:
                    created = dist.new_group(ranks)
                    if rank in ranks:
                        mine[kind] = created
    return mine["ep"], mine["expert_dp"], mine.get("ep_backward")


def gradient_group(layout: ParallelLayout, mesh: DeviceMesh) -> dist.ProcessGroup:
    """The dp x cp ranks of this rank's stage (the dp group alone when cp = 1)."""
    if layout.cp == 1:
        return mesh.get_group("dp")
    return mesh["dp", "cp"]._flatten("dp_cp").get_group()
