"""Process groups for a layout: a DeviceMesh over (pp, dp, tp) plus the groups that join stages
holding copies of a tied parameter."""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from models.spec import LayerModel

from .layout import ParallelLayout


@dataclass
class ProcessGroups:
    mesh: DeviceMesh
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    tp: dist.ProcessGroup
    tied: list[dist.ProcessGroup | None]   # per model.tied group: mine, or None if not split


def layer_owner(layout: ParallelLayout, bounds: list[tuple[int, int]], layer: int) -> int:
    """The pipeline rank that holds ``layer``."""
    for virtual_stage, (start, end) in enumerate(bounds):
        if start <= layer < end:
            return virtual_stage % layout.pp
    raise ValueError(f"layer {layer} is in no stage")


def build_groups(layout: ParallelLayout, rank: int, device_type: str, model: LayerModel,
                 bounds: list[tuple[int, int]]) -> ProcessGroups:
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
