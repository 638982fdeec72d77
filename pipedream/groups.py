"""Process groups for a layout: a DeviceMesh over (pp, dp, tp) plus the groups that join stages
holding copies of a tied parameter. With ``stage_replicas`` (1F1B-RR) there is no grid: ``dp`` is
the group of this rank's stage replicas, which all-reduce gradients before each update."""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from models.spec import LayerModel

from .layout import ParallelLayout


@dataclass
class ProcessGroups:
    mesh: DeviceMesh | None                # None with stage_replicas (no grid)
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup                  # replicas of this rank's stage
    tp: dist.ProcessGroup | None
    tied: list[dist.ProcessGroup | None]   # per model.tied group: mine, or None if not split


def layer_owner(layout: ParallelLayout, bounds: list[tuple[int, int]], layer: int) -> int:
    """The pipeline rank that holds ``layer``."""
    for virtual_stage, (start, end) in enumerate(bounds):
        if start <= layer < end:
            return virtual_stage % layout.pp
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
    return ProcessGroups(mesh=None, pp=dist.group.WORLD, dp=mine, tp=None, tied=[None] * len(model.tied))


def build_groups(layout: ParallelLayout, rank: int, device_type: str, model: LayerModel,
                 bounds: list[tuple[int, int]]) -> ProcessGroups:
    if layout.stage_replicas:
        return build_replicated_groups(layout, rank, model)
    mesh = init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))
    me = layout.coords(rank)
    tied: list[dist.ProcessGroup | None] = []
    for group in model.tied:
        pp_ranks = sorted({layer_owner(layout, bounds, layer) for layer, _ in group})
        mine = None
        if len(pp_ranks) > 1:
            # every rank creates every group, in the same order, as new_group requires
            for dp_rank in range(layout.dp):
                for tp_rank in range(layout.tp):
                    ranks = [layout.rank_of(p, dp_rank, tp_rank) for p in pp_ranks]
                    created = dist.new_group(ranks)
                    if (me.dp, me.tp) == (dp_rank, tp_rank) and me.pp in pp_ranks:
                        mine = created
        tied.append(mine)
    return ProcessGroups(mesh=mesh, pp=mesh.get_group("pp"), dp=mesh.get_group("dp"), tp=mesh.get_group("tp"),
                         tied=tied)
