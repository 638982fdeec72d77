"""Finding and composing the Hydra configs; torch-free, shared by the launcher, the planner, scripts
and tests.

The configs are the top-level package ``conf``: the repository's ``conf/`` in a checkout, and the
same files installed next to ``pipedream`` by ``pip install .``. ``pipedream.train``'s
``@hydra.main(config_path="../conf")`` resolves to that package too (Hydra turns it into
``pkg://conf`` when run with ``-m``).
"""
from __future__ import annotations

import difflib
import re
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
        cfg = compose(config_name, overrides=list(overrides), return_hydra_config=return_hydra_config)
    return complete_model_config(cfg)


def complete_model_config(cfg: Any) -> Any:
    """Fills the model keys a family reads from the model's own files (``ModelFamily.config_from_files``,
    e.g. ``model=hf``'s config.json) where the config leaves them null; a key given on the command
    line stays. Raises ``ConfigError`` (one line) when those files cannot be read."""
    from omegaconf import open_dict

    from models.registry import known_family
    model = cfg.get("model") if hasattr(cfg, "get") else None
    family = known_family(model.get("name")) if model is not None else None
    if family is None or family.config_from_files is None:
        return cfg
    derived = family.config_from_files(model)
    with open_dict(model):
        for key, value in derived.items():
            if model.get(key) is None:
                model[key] = value
    return cfg


def describe_missing_option(error: Exception) -> str:
    """A Hydra ``MissingConfigException`` as one line: 'model=nope is unknown: choose one of ...'."""
    group, _, name = str(getattr(error, "missing_cfg_file", None) or "").partition("/")
    options = config_options(group) if group else []
    if options:
        return f"{group}={name} is unknown: choose one of {', '.join(options)} (files in conf/{group}/)"
    return str(error).splitlines()[0]



def describe_composition_error(error: Exception, overrides: Sequence[str] = (), config_name: str = "config") -> str:
    """Any error Hydra or OmegaConf raises while composing, as one line: an unknown config choice
    (``describe_missing_option``), a misspelt key (``describe_unknown_key``), else the first line."""
    from hydra.errors import MissingConfigException
    if isinstance(error, MissingConfigException):
        return describe_missing_option(error)
    key = unknown_override_key(error)
    if key is not None:
        return describe_unknown_key(key, reference_config(overrides, key, config_name))
    return str(error).splitlines()[0] if str(error).strip() else type(error).__name__


def unknown_override_key(error: Exception) -> str | None:
    """``train.step`` for Hydra's "Could not override 'train.step'." (a key the config does not have)."""
    match = re.match(r"Could not override '([^']+)'", str(error))
    return match.group(1) if match else None


def _override_key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def reference_config(overrides: Sequence[str], key: str, config_name: str = "config") -> Any:
    """The config the user meant: ``overrides`` without the ones setting ``key`` (the group choices
    decide which keys exist), or the defaults when those fail too."""
    rest = [o for o in overrides if _override_key(o) != key]
    try:
        return compose_config(rest, config_name)
    except Exception:  # noqa: BLE001 - another bad override: the defaults still name the keys
        return compose_config((), config_name)


def config_paths(node: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a composed config (groups and values), without resolving interpolations."""
    from omegaconf import DictConfig
    paths = []
    for name in node.keys():
        path = f"{prefix}{name}"
        paths.append(path)
        child = node._get_node(name)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            paths += config_paths(child, path + ".")
    return paths


def suggest_key(key: str, cfg: Any) -> tuple[str | None, str, list[str]]:
    """(the closest existing key or None, the deepest group of ``key`` that exists, that group's keys)."""
    from omegaconf import DictConfig
    parts, node, depth = key.split("."), cfg, 0
    while depth < len(parts) - 1 and isinstance(node, DictConfig) and parts[depth] in node:
        child = node._get_node(parts[depth])
        if not isinstance(child, DictConfig):
            break
        node, depth = child, depth + 1
    group = ".".join(parts[:depth])
    keys = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
    paths = config_paths(cfg)
    suggestion = None
    local = difflib.get_close_matches(parts[depth], keys, n=1)
    if local:
        guess = ".".join([*parts[:depth], local[0], *parts[depth + 1:]])
        suggestion = guess if guess in paths else ".".join([*parts[:depth], local[0]])
    else:   # a key of another group ("optim.lrr": train.lr), else the closest dotted key
        leaves = {path.rpartition(".")[2]: path for path in reversed(paths)}
        leaf = difflib.get_close_matches(parts[-1], list(leaves), n=1, cutoff=0.75)
        anywhere = [leaves[leaf[0]]] if leaf else difflib.get_close_matches(key, paths, n=1, cutoff=0.75)
        suggestion = anywhere[0] if anywhere else None
    return suggestion, group, keys


def describe_unknown_key(key: str, cfg: Any) -> str:
    """'train.step is not a config key; did you mean train.steps? (keys of train: ...)'."""
    suggestion, group, keys = suggest_key(key, cfg)
    where = f"keys of {group}" if group else "top-level keys"
    listed = f"{where}: {', '.join(keys)}"
    if suggestion:
        return f"{key} is not a config key; did you mean {suggestion}? ({listed})"
    return f"{key} is not a config key ({listed}): check its spelling, or write +{key}=VALUE to add a new key"
