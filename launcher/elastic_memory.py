"""Before an elastic launch: the fewest nodes the job may shrink to (``launcher.min_nodes``) must hold
the model. The layout a smaller world runs is the one the ranks will choose
(``pipedream.config.elastic.layout_for_world``); where its estimated memory per node exceeds this
machine's, the launch is refused in one line naming how many devices the model needs."""
from __future__ import annotations

from typing import Any, Callable

from pipedream.config.elastic import ElasticSpec, layout_for_world
from pipedream.errors import ConfigError

from launcher.memory_check import check_memory


def check_smallest_world(label: str, cfg: Any, elastic: ElasticSpec, per_node: int,
                         spec_for: Callable[[Any, int], Any], available: float | None = None) -> None:
    """``spec_for(cfg, world)`` is the run spec of ``cfg`` on ``world`` devices (ConfigError if refused)."""
    if not elastic.enabled:
        return
    failures = []
    for nodes in range(elastic.min_nodes, elastic.nnodes):
        world = nodes * per_node
        try:
            relaid = layout_for_world(cfg, world, lambda c: spec_for(c, world))
            check_memory(label, relaid, spec_for(relaid, world), per_node, available)
        except ConfigError as error:
            failures.append((nodes, str(error)))
            continue
        break
    if not failures or failures[0][0] != elastic.min_nodes:
        return
    fits = elastic.min_nodes + len(failures)
    first = failures[0][1]
    raise ConfigError(f"launcher.min_nodes = {elastic.min_nodes}: on {elastic.min_nodes * per_node} devices the "
                      f"re-laid run does not fit ({first}); the model needs {fits * per_node} devices "
                      f"({fits} nodes): set launcher.min_nodes={fits}")
