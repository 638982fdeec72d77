"""Builds torchrun command lines for a training config: one node, or one line per node."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipedream.config.elastic import ElasticSpec
from pipedream.errors import ConfigError

from launcher.binding import numa_options

KEEP_ALIVE_S = 1   # elastic: seconds between a node's rendezvous heartbeats


@dataclass(frozen=True)
class LaunchPlan:
    world_size: int
    nnodes: int
    nproc_per_node: int
    commands: list[list[str]]   # one per node, starting with "torchrun"


def world_size_of(cfg: Any) -> int:
    """Processes the job needs: from the plan file if one is given, else the sum of
    ``parallel.stage_replicas`` or pp * tp * cp * dp."""
    plan_path = cfg.parallel.get("plan")
    if plan_path:
        from pipedream.config.plan_file import PlanError, load_plan
        try:
            return int(load_plan(str(plan_path)).world_size)
        except PlanError as error:
            raise ConfigError(str(error)) from None
    replicas = cfg.parallel.get("stage_replicas")
    if replicas:  # 1F1B-RR (schedule=pipedream): the stages' replica counts add up
        return sum(int(r) for r in replicas) * int(cfg.parallel.tp)
    cp = cfg.parallel.get("cp") or 1   # (absent in configs that predate it)
    return int(cfg.parallel.pp) * int(cfg.parallel.tp) * int(cp) * int(cfg.parallel.dp)


def build_launch(cfg: Any, overrides: list[str], run_dir: str) -> LaunchPlan:
    """``overrides`` are passed on to every rank, with the resolved ``train.run_dir`` appended so all
    nodes write to the same run (the default holds a timestamp)."""
    world = world_size_of(cfg)
    nnodes = int(cfg.launcher.nnodes)
    if nnodes < 1:
        raise ConfigError(f"launcher.nnodes = {nnodes} must be >= 1")
    if world % nnodes:
        raise ConfigError(f"the job needs {world} processes, which launcher.nnodes = {nnodes} does not divide: "
                          f"use a node count that divides {world}")
    per_node = world // nnodes
    elastic = ElasticSpec.from_config(cfg)
    elastic_args = [f"launcher.nnodes={nnodes}", f"launcher.min_nodes={elastic.min_nodes}"] if elastic.enabled else []
    train_args = ["-m", "pipedream.train", *[o for o in overrides if not o.startswith("train.run_dir=")],
                  *elastic_args, f"train.run_dir={run_dir}"]   # (the ranks re-lay an elastic run themselves)
    restarts = [f"--max-restarts={int(cfg.launcher.max_restarts)}",
                *numa_options(cfg.launcher.get("bind_cores", "auto"), str(cfg.cluster.get("device", "cpu")))]
    if elastic.enabled:   # the first world waits for every node; a dead node's entry expires in KEEP_ALIVE_S * 3
        nodes = f"{elastic.min_nodes}:{nnodes}"
        rdzv_conf = (f"join_timeout={float(cfg.launcher.rendezvous_timeout_s):g},"
                     f"last_call_timeout={float(cfg.launcher.rendezvous_timeout_s):g},"
                     f"keep_alive_interval={KEEP_ALIVE_S},keep_alive_max_attempt=3")
    else:
        nodes, rdzv_conf = str(nnodes), f"join_timeout={float(cfg.launcher.rendezvous_timeout_s):g}"
    if nnodes == 1:
        commands = [["torchrun", "--standalone", f"--nproc-per-node={per_node}", *restarts, *train_args]]
    else:
        endpoint = f"{cfg.launcher.master_addr}:{int(cfg.launcher.master_port)}"
        commands = [["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={per_node}", f"--node-rank={node}",
                     "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=pipedream",
                     f"--rdzv-conf={rdzv_conf}", *restarts,
                     *train_args] for node in range(nnodes)]
    return LaunchPlan(world, nnodes, per_node, commands)
