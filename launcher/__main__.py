"""``python -m launcher [hydra overrides]``: validates the config, then runs torchrun with the right
number of processes (one node), or prints / runs the command of each node (``launcher.nnodes > 1``)."""
from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from pipedream.checkpoint.memory_folders import NODE_ENV, clear_node
from pipedream.config.elastic import ELASTIC_PLANS, check_elastic
from pipedream.config.loading import compose_config, describe_composition_error, group_choice
from pipedream.errors import ConfigError

from pipedream.runtime.affinity import ENV as CORE_SETS, format_core_sets

from launcher.advice import launch_warnings, layout_line
from launcher.binding import core_sets
from launcher.commands import build_launch
from launcher.elastic_agent import elastic_agent_options
from launcher.elastic_memory import check_smallest_world
from launcher.elastic_plans import plan_worlds
from launcher.memory_check import check_memory
from launcher.prechecks import check_before_launch, check_launch_keys
from launcher.preempt import agent_options, job_exit_code, relayed_signals
from launcher.sbatch import emit_script
from launcher.slurm import apply_allocation
from launcher.supervise import run_supervised


def model_label(cfg: Any, argv: list[str]) -> str:
    """How the user named the model, as the planner labels it: a plugin's ``model._target_``, else the
    ``model=`` choice (the default's where none is given)."""
    if cfg.model.get("_target_"):
        return str(cfg.model._target_)
    return str(group_choice("model", argv) or cfg.model.get("name"))


def check_buildable(cfg: Any, label: str) -> None:
    if cfg.model.get("planner_only"):
        raise ConfigError(f"model={label} is planner-only (analytic sizes, far too large to build here): "
                          f"plan it with `python -m planner model={label}`, or train a small preset "
                          f"(e.g. model=gpt_tiny or model=gpt_small)")


def main(argv: list[str]) -> int:
    overrides = [a for a in argv if not a.startswith("launcher.")]
    try:
        cfg, slurm_notes = apply_allocation(compose_config(argv), argv, os.environ)
        from pipedream.config.plan_config import apply_plan
        from pipedream.observe.run_outputs import claim_run_dir
        from pipedream.config.run_spec import build_run_spec
        from models import checked_plugin
        label = model_label(cfg, argv)
        run_dir = str(cfg.train.run_dir)
        check_launch_keys(cfg)
        elastic = check_elastic(cfg)
        plan = build_launch(cfg, overrides, run_dir)
        plugin = checked_plugin(cfg.model)   # a model plugin is imported, built and checked once, here
        spec = build_run_spec(apply_plan(cfg, plugin, label), plan.world_size, plugin)
        check_buildable(cfg, label)
        preemption = spec.preemption
        if cfg.launcher.emit:
            print(emit_script(cfg, argv, plan.world_size), end="")
            return 0
        launching = not cfg.launcher.dry_run and (plan.nnodes == 1 or cfg.launcher.get("node_rank") is not None)
        hosts_rendezvous = launching and plan.nnodes > 1 and int(cfg.launcher.node_rank) == 0
        for warning in check_before_launch(cfg, spec, run_dir, launching, hosts_rendezvous):
            print(warning, file=sys.stderr)
        if launching and bool(cfg.launcher.check_memory):
            note = check_memory(label, cfg, spec, plan.nproc_per_node)
            if note:
                print(note, file=sys.stderr)
            if not cfg.parallel.get("plan"):   # a plan-file run's worlds are sized by the planner (below)
                check_smallest_world(label, cfg, elastic, plan.nproc_per_node,
                                     lambda relaid, world: build_run_spec(apply_plan(relaid, plugin, label), world,
                                                                          plugin))
        if launching and elastic.enabled and cfg.parallel.get("plan"):
            plans = Path(tempfile.mkdtemp(prefix="pipedream-elastic-plans-"))
            for line in plan_worlds(cfg, overrides, label, elastic, plan.nproc_per_node, plans):
                print(line, flush=True)
            os.environ[ELASTIC_PLANS] = str(plans)   # the ranks this node starts read their world's plan there
        cores = core_sets(cfg.launcher.get("bind_cores", "auto"), str(cfg.cluster.get("device", "cpu")),
                          plan.nproc_per_node, sorted(os.sched_getaffinity(0)))
        if launching and int(cfg.launcher.get("node_rank") or 0) == 0:   # one node claims the shared run dir
            claim_run_dir(spec, Path(run_dir))
        if launching:   # last: a refused launch prints its error alone
            for note in launch_warnings(cfg, plan.nproc_per_node, len(os.sched_getaffinity(0))):
                print(f"warning: {note}", file=sys.stderr)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (HydraException, OmegaConfBaseException) as error:  # unknown choice or key, bad override syntax
        print(f"error: {describe_composition_error(error, argv)}", file=sys.stderr)
        return 2
    node_rank = cfg.launcher.get("node_rank")
    if cfg.launcher.dry_run or (plan.nnodes > 1 and node_rank is None):
        print("".join(f"# {note}\n" for note in slurm_notes), end="")
        print(f"# {layout_line(spec)}")
        for node, command in enumerate(plan.commands):
            prefix = f"# node {node}\n" if plan.nnodes > 1 else ""
            print(prefix + shlex.join(command))
        return 0
    command = plan.commands[int(node_rank or 0)]
    if elastic.enabled:   # this node's in-memory copies start empty, as a (re)started machine's memory does
        os.environ[NODE_ENV] = str(int(node_rank or 0))
        clear_node(Path(run_dir), int(node_rank or 0))
    bound = ""
    if cores is not None:   # each rank pins itself to its set before torch starts (pipedream.runtime.affinity)
        os.environ[CORE_SETS] = format_core_sets(cores)
        bound = "; cores per local rank " + " ".join(f"[{','.join(map(str, c))}]" for c in cores)
    # torchrun sets this to 1 with a four-line notice when unset; the ranks set train.threads themselves
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.train.threads))
    print(f"launch: {plan.world_size} processes ({plan.nproc_per_node} on this node), {layout_line(spec)}; "
          f"run dir {run_dir}{bound}", flush=True)
    runnable = [sys.executable, "-m", "launcher.agent", *elastic_agent_options(cfg, elastic), *agent_options(preemption),
                *command[1:]]
    try:
        code = run_supervised(runnable, float(cfg.launcher.grace_s), relayed_signals(preemption))
    finally:
        if ELASTIC_PLANS in os.environ:
            shutil.rmtree(os.environ[ELASTIC_PLANS], ignore_errors=True)
    return job_exit_code(code, Path(run_dir), preemption)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # Ctrl-C before the job started
        sys.exit(130)
