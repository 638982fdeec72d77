"""``python -m launcher [hydra overrides]``: validates the config, then runs torchrun with the right
number of processes (one node), or prints / runs the command of each node (``launcher.nnodes > 1``)."""
from __future__ import annotations

import shlex
import subprocess
import sys

from hydra.errors import HydraException, MissingConfigException
from omegaconf.errors import OmegaConfBaseException

from pipedream.config_loading import compose_config, describe_missing_option
from pipedream.errors import ConfigError

from .commands import build_launch


def main(argv: list[str]) -> int:
    overrides = [a for a in argv if not a.startswith("launcher.")]
    try:
        cfg = compose_config(argv)
        from pipedream.plan_config import apply_plan
        from pipedream.run_spec import build_run_spec
        run_dir = str(cfg.train.run_dir)
        plan = build_launch(cfg, overrides, run_dir)
        build_run_spec(apply_plan(cfg), plan.world_size)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except MissingConfigException as error:
        print(f"error: {describe_missing_option(error)}", file=sys.stderr)
        return 2
    except (HydraException, OmegaConfBaseException) as error:  # bad override syntax, unknown key
        print(f"error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    node_rank = cfg.launcher.get("node_rank")
    if cfg.launcher.dry_run or (plan.nnodes > 1 and node_rank is None):
        for node, command in enumerate(plan.commands):
            prefix = f"# node {node}\n" if plan.nnodes > 1 else ""
            print(prefix + shlex.join(command))
        return 0
    command = plan.commands[int(node_rank or 0)]
    print(f"launch: {plan.world_size} processes ({plan.nproc_per_node} on this node); run dir {run_dir}", flush=True)
    runnable = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
    return subprocess.call(runnable)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
