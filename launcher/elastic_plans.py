"""An elastic run started from a plan file (``parallel.plan``): before launch the planner plans every
world the job may re-form into (``launcher.min_nodes`` .. ``launcher.nnodes`` nodes of this node's
process count), with the run's own model, the plan's cluster sheet, precision and global batch.
Each (re)started rank then trains the plan of its world (``pipedream.train.for_this_world`` reads the
folder ``ELASTIC_PLANS`` names). A node count that no plan fits is refused at launch when it is
``launcher.min_nodes`` (the line names the smallest count that fits), else reported and skipped."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pipedream.config.elastic import ElasticSpec, world_plan_path
from pipedream.config.plan_file import PlanError, load_plan
from pipedream.errors import ConfigError

PLANNED_KEYS = ("model.", "planner.")   # the user's overrides the planner reads as the run does


def plan_worlds(cfg: Any, argv: list[str], label: str, elastic: ElasticSpec, per_node: int,
                folder: Path) -> list[str]:
    """Writes one plan per node count into ``folder``; returns a progress line per node count."""
    from planner.config import compose, inputs_from_config
    from planner.errors import DoesNotFitError, PlannerError
    from planner.search.auto import make_plan

    if cfg.model.get("_target_"):
        raise ConfigError("parallel.plan with launcher.min_nodes (elastic) needs a model the planner sizes "
                          "analytically: for a plugin give the plan's degrees as parallel.pp/tp/dp instead")
    try:
        plan = load_plan(str(cfg.parallel.plan))
    except PlanError as error:
        raise ConfigError(str(error)) from None
    base = [f"model={label}", *(a for a in argv if a.startswith(PLANNED_KEYS)), f"cluster={plan.cluster.name}",
            f"cluster.devices_per_node={per_node}", f"train.global_batch_size={plan.batch.global_batch}"]
    if plan.precision:
        base.append(f"planner.precision={plan.precision}")
    lines, smallest = [], None
    for nodes in range(elastic.min_nodes, elastic.nnodes + 1):
        world = nodes * per_node
        try:
            outcome = make_plan(inputs_from_config(compose(base + [f"cluster.nodes={nodes}"])), simulate=False)
        except DoesNotFitError as error:
            lines.append(f"elastic: no plan fits {nodes} node(s) ({world} devices): {error}")
            continue
        except PlannerError as error:
            raise ConfigError(f"re-planning for {nodes} node(s) of the elastic run: {error}") from None
        smallest = smallest or nodes
        outcome.plan.save(world_plan_path(folder, world))
        best = outcome.result.best
        lines.append(f"elastic: planned {nodes} node(s) ({world} devices): pp={best.pp} tp={best.tp} cp={best.cp} "
                     f"dp={best.dp}, {best.schedule}")
    if smallest != elastic.min_nodes:
        needed = f"{smallest} nodes" if smallest else f"more than {elastic.nnodes} nodes"
        raise ConfigError(f"launcher.min_nodes = {elastic.min_nodes}: no plan fits {elastic.min_nodes * per_node} "
                          f"devices; the model needs {needed}: raise launcher.min_nodes")
    return lines
