"""Finding and composing the Hydra configs; torch-free, shared by the launcher, the planner, scripts
and tests.

The configs are the top-level package ``conf``: the repository's ``conf/`` in a checkout, and the
same files installed next to ``pipedream`` by ``pip install .``. ``pipedream.train``'s
``@hydra.main(config_path="../conf")`` resolves to that package too (Hydra turns it into
``pkg://conf`` when run with ``-m``).
"""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Any, Sequence


def config_dir() -> Path:
    """The folder holding ``config.yaml``, ``planner.yaml`` and the config groups."""
    return Path(str(files("conf")))


def config_options(group: str) -> list[str]:
    """The choices of a config group: ``config_options("optim")`` -> ``["adamw", "sgd"]``."""
    return sorted(path.stem for path in (config_dir() / group).glob("*.yaml"))


def compose_config(overrides: Sequence[str] = (), config_name: str = "config",
                   return_hydra_config: bool = False) -> Any:
    """``conf/<config_name>.yaml`` with ``overrides`` applied, through Hydra's Compose API (no
    working-directory change, no outputs/ folder). Raises Hydra's and OmegaConf's errors.
    ``model._target_=...`` / ``data._target_=...`` replace the preset (``plugin_config``)."""
    from hydra import compose, initialize_config_dir

    from models.plugin_config import plugin_overrides
    overrides = plugin_overrides(overrides)

    with initialize_config_dir(str(config_dir()), version_base=None):
        return compose(config_name, overrides=list(overrides), return_hydra_config=return_hydra_config)


def describe_missing_option(error: Exception) -> str:
    """A Hydra ``MissingConfigException`` as one line: 'model=nope is unknown: choose one of ...'."""
    group, _, name = str(getattr(error, "missing_cfg_file", None) or "").partition("/")
    options = config_options(group) if group else []
    if options:
        return f"{group}={name} is unknown: choose one of {', '.join(options)} (files in conf/{group}/)"
    return str(error).splitlines()[0]

