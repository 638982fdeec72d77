"""Training entry point: ``torchrun --nproc-per-node N -m pipedream.train [hydra overrides]``
(``python -m launcher`` computes N and runs this for you).

Errors end the run with one line on stderr (``failures.failure_line``) and a non-zero exit: 2 for
a configuration refused before any process group exists, 3 for a deterministic failure later (bad
data, NaN, no usable checkpoint: restarting cannot help, so the launcher does not), 1 for anything
else. ``train.debug=true`` or ``PIPEDREAM_DEBUG=1`` adds the traceback of an unexpected error.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from pipedream.lifecycle.parent_watch import watch_parent
from pipedream.runtime.affinity import bind_this_rank

if __name__ == "__main__":
    watch_parent()   # first: this rank ends with torchrun's agent, however that dies
BOUND_CORES = bind_this_rank()   # before torch starts its thread pools: every pool thread inherits the set

import hydra  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig

from pipedream.runtime.distributed import init_distributed, shutdown, world_size_from_env
from pipedream.errors import FINAL_EXIT, REFUSED_EXIT, ConfigError, stderr_line
from pipedream.config.loading import complete_model_config
from pipedream.config.plan_config import apply_plan, check_plan_world_size
from pipedream.observe.run_outputs import claim_run_dir
from pipedream.config.run_spec import build_run_spec
from models import checked_plugin


def first_attempt_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def for_this_world(cfg: Any, plugin: Any) -> tuple[Any, bool]:
    """``cfg`` as this attempt runs it, and whether the run is elastic. An elastic run always continues
    from its newest complete checkpoint (a node that joins late must agree with the others), and a
    world of another size than the degrees' gets the nearest layout that fits it
    (``pipedream.config.elastic``): every rank computes the same from the same config. A run from a
    plan file trains the plan the launcher made for its world (``launcher.elastic_plans``)."""
    from pipedream.config.elastic import (ELASTIC_PLANS, check_elastic, configured_world, layout_for_world,
                                          planned_for_world, resuming_copy)
    if not check_elastic(cfg).enabled:
        return cfg, False
    world = world_size_from_env()
    cfg = resuming_copy(cfg)
    if cfg.parallel.get("plan") and os.environ.get(ELASTIC_PLANS):   # a plan-file run: the planner's plan
        return planned_for_world(cfg, world, os.environ[ELASTIC_PLANS]), True
    if world != configured_world(cfg):
        cfg = layout_for_world(cfg, world, lambda relaid: build_run_spec(apply_plan(relaid, plugin), world, plugin))
    return cfg, True


def run(cfg: Any) -> int:
    """Validates, trains, and returns an exit code; errors become one line on stderr."""
    try:
        cfg = complete_model_config(cfg)   # as compose_config does: @hydra.main composed this one
        plugin = checked_plugin(cfg.model)   # a model plugin is imported, built and checked once, here
        cfg, elastic = for_this_world(cfg, plugin)
        check_plan_world_size(cfg, world_size_from_env())
        cfg = apply_plan(cfg, plugin)
        spec = build_run_spec(cfg, world_size_from_env(), plugin)   # the last read of cfg: below, the spec only
        if first_attempt_rank0() and not elastic:   # (an elastic run's launcher has claimed it)   # before any rank writes; a torchrun restart finds its own outputs
            claim_run_dir(spec, Path(spec.loop.run_dir))
            from pipedream.data.checks import check_data   # what the launcher checks, for runs started by torchrun
            for note in check_data(spec.data_config, spec.model_config, spec.seq_len):
                stderr_line(f"warning: {note}")
    except ConfigError as error:
        stderr_line(f"error: {error}")
        return REFUSED_EXIT
    torch.set_num_threads(len(BOUND_CORES) if BOUND_CORES else spec.train.threads)   # a bound rank: one per core
    # imported late: a refused configuration fails fast
    from pipedream.lifecycle.failures import (AGREED_ERRORS, USER_ERRORS, debug_requested, failure_report,
                                              is_communication_failure, wait_for_peer_report)
    from pipedream.trainer import train
    from pipedream.lifecycle.elastic_run import REFORM_EXIT, ReformRequested
    try:
        ctx = init_distributed(spec.device, spec.train.timeout_s)
        train(spec, ctx)
    except ReformRequested:
        return REFORM_EXIT   # torchrun re-forms the world with the node that joined
    except Exception as error:  # noqa: BLE001 - every failure becomes one line (and a traceback on request)
        rank = int(os.environ.get("RANK", "0"))
        if elastic and is_communication_failure(error):   # a node lost: torchrun re-forms the world at once
            stderr_line(f"elastic: rank {rank} lost a peer ({type(error).__name__}); the job re-forms on the nodes "
                        f"left and resumes from the newest checkpoint")
            return 1
        wait_for_peer_report(error)
        if rank == 0 or not isinstance(error, AGREED_ERRORS):   # every rank sees a NaN, a failed save: one line
            stderr_line(failure_report(error, rank, spec.train.timeout_s, debug_requested(spec.train.debug)))
        return FINAL_EXIT if isinstance(error, USER_ERRORS) else 1   # the launcher does not restart FINAL_EXIT
    finally:
        shutdown()
    return 0


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    code = run(cfg)
    if code:
        sys.exit(code)


def main_refusing_bad_overrides(argv: list[str]) -> None:
    """``main``, but a config Hydra cannot compose (a misspelt key, an unknown choice) ends in one line
    and exit code 2 instead of Hydra's multi-line report; ``HYDRA_FULL_ERROR=1`` keeps Hydra's traceback."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        main()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"   # Hydra then raises the error rather than printing it
    try:
        main()
    except (HydraException, OmegaConfBaseException) as error:
        from pipedream.config.loading import describe_composition_error
        stderr_line(f"error: {describe_composition_error(error, [a for a in argv if not a.startswith('-')])}")
        sys.exit(REFUSED_EXIT)
    finally:
        del os.environ["HYDRA_FULL_ERROR"]


if __name__ == "__main__":
    from models.plugin_config import plugin_overrides
    sys.argv[1:] = plugin_overrides(sys.argv[1:])   # model._target_=...: see plugin_config
    main_refusing_bad_overrides(sys.argv[1:])
