"""Finding and composing the Hydra configs; torch-free, shared by the launcher, the planner, scripts
and tests.

The configs are the top-level package ``conf``: the repository's ``conf/`` in a checkout, and the
same files installed next to ``pipedream`` by ``pip install .``. ``pipedream.train``'s
``@hydra.main(config_path="../conf")`` resolves to that package too (Hydra turns it into
``pkg://conf`` when run with ``-m``).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from pipedream.config.yaml_files import ConfigFiles, NotPlain


def config_dir() -> Path:
    """The folder holding ``config.yaml``, ``planner.yaml`` and the config groups (the package's own
    folder: ``importlib.resources`` would cost a small run's start-up its zipfile imports)."""
    import conf

    return Path(conf.__file__).parent


def config_options(group: str) -> list[str]:
    """The choices of a config group: ``config_options("optim")`` -> ``["adamw", "sgd"]``."""
    return sorted(path.stem for path in (config_dir() / group).glob("*.yaml"))


def group_choice(group: str, overrides: Sequence[str] = (), config_name: str = "config") -> str | None:
    """The option ``group`` takes: the last ``group=option`` override, else the primary config's
    default (``model`` -> ``gpt_tiny``); None where the defaults list does not choose it."""
    chosen = [o.partition("=")[2] for o in overrides if o.partition("=")[0].lstrip("+") == group]
    if chosen:
        return chosen[-1]
    files = ConfigFiles(config_dir())
    entries = files.load(config_dir() / f"{config_name}.yaml").get("defaults") or []
    return next((str(e[group]) for e in entries if isinstance(e, dict) and group in e), None)


def compose_config(overrides: Sequence[str] = (), config_name: str = "config",
                   return_hydra_config: bool = False) -> Any:
    """``conf/<config_name>.yaml`` with ``overrides`` applied, through Hydra's Compose API (no
    working-directory change, no outputs/ folder), or ``compose_plain`` where it gives the same
    config without Hydra. Raises Hydra's and OmegaConf's errors.
    ``model._target_=...`` / ``data._target_=...`` replace the preset (``plugin_config``)."""
    if not return_hydra_config:   # plain overrides: the same config without importing Hydra
        plain = compose_plain(overrides, config_name, without_hydra_node=True)
        if plain is not None:
            return plain[0]
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


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_INT = re.compile(r"-?(0|[1-9][0-9]*)$")
_FLOAT = re.compile(r"-?(\d+\.\d*|\.\d+)([eE][+-]?\d+)?$|-?\d+[eE][+-]?\d+$")
_WORD = re.compile(r"[A-Za-z_/.][A-Za-z0-9_./-]*$|[0-9][A-Za-z0-9./-]*[A-Za-z][A-Za-z0-9./-]*$")   # 1f1b, not 1_000
_WORDS_HYDRA_READS_OTHERWISE = {"true", "false", "null", "inf", "nan"}   # in any case


def _plain_scalar(text: str) -> Any:
    if text in ("true", "false"):
        return text == "true"
    if text == "null":
        return None
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    if _WORD.match(text) and text.lower() not in _WORDS_HYDRA_READS_OTHERWISE:
        return text
    raise NotPlain(text)


def plain_value(text: str) -> Any:
    """The value of ``key=text`` as Hydra's override grammar reads it, for the plain forms only (an
    int, a float, true/false/null, a word of letters, digits, ``_./-`` and a list of those);
    anything else raises ``NotPlain``."""
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1]
        return [] if inner == "" else [_plain_scalar(item) for item in inner.split(",")]
    return _plain_scalar(text)


def _register_hydra_now_resolver() -> None:
    """``${now:...}`` (``train.run_dir``'s default) resolves as in a Hydra-composed config: the
    resolver Hydra registers when it composes (``hydra.core.utils.setup_globals``, the same
    definition, so either may register it first)."""
    from datetime import datetime

    from omegaconf import OmegaConf
    if not OmegaConf.has_resolver("now"):
        OmegaConf.register_new_resolver("now", lambda pattern: datetime.now().strftime(pattern), use_cache=True)


def _merge(into: dict, other: dict) -> None:
    """OmegaConf's merge of plain containers: mappings merge key by key, anything else replaces."""
    for key, value in other.items():
        if isinstance(into.get(key), dict) and isinstance(value, dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _update(cfg: dict, key: str, value: Any) -> None:
    """``OmegaConf.update(cfg, key, value, merge=True)`` on a struct config, for an existing key whose
    value is not a mapping (a new key is an error Hydra words; a scalar over a mapping is Hydra's too)."""
    *parents, last = key.split(".")
    node = cfg
    for part in parents:
        node = node.get(part)
        if not isinstance(node, dict):
            raise NotPlain(key)
    if last not in node or isinstance(node[last], dict):
        raise NotPlain(key)
    node[last] = value


def _compose_data(overrides: Sequence[str], config_name: str,
                  without_hydra_node: bool) -> tuple[dict, dict[str, str]]:
    """``compose_plain``'s composition as plain containers (YAML values, not yet OmegaConf nodes) and
    the group choices; raises ``NotPlain`` for anything it does not reproduce."""
    root = config_dir()
    files = ConfigFiles(root)
    try:
        return _compose_files(files, overrides, config_name, without_hydra_node)
    finally:
        files.save()


def _compose_files(files: ConfigFiles, overrides: Sequence[str], config_name: str,
                   without_hydra_node: bool) -> tuple[dict, dict[str, str]]:
    root = files.root
    primary = files.load(root / f"{config_name}.yaml")
    choices, values, seen = {}, [], set()
    for override in overrides:
        key, eq, text = override.partition("=")
        if not eq or not _KEY.match(key) or key in seen or key.split(".")[0] == "hydra":
            raise NotPlain(override)
        seen.add(key)
        if "." not in key:   # a group choice
            if not (root / key).is_dir() or not _WORD.match(text):
                raise NotPlain(override)
            choices[key] = text
        else:
            values.append((key, plain_value(text)))
    entries = primary.pop("defaults", None)
    if without_hydra_node and isinstance(entries, list):
        primary.pop("hydra", None)
        entries = [e for e in entries if not (isinstance(e, dict) and len(e) == 1
                                              and next(iter(e)).startswith("override hydra/"))]
    if not isinstance(entries, list) or "_self_" not in entries:
        raise NotPlain("defaults")
    if any(not (isinstance(e, dict) and len(e) == 1) and e != "_self_" for e in entries):
        raise NotPlain("defaults")   # optional entries, overrides of Hydra's own groups, packages
    if set(choices) - {next(iter(e)) for e in entries if isinstance(e, dict)}:
        raise NotPlain("a group the defaults do not choose")
    cfg: dict = {}
    chosen = {}
    for entry in entries:
        if entry == "_self_":
            _merge(cfg, primary)
            continue
        (group, option), = entry.items()
        option = choices.get(group, option)
        path = root / group / f"{option}.yaml"
        if not isinstance(option, str) or not path.is_file():
            raise NotPlain(group)
        loaded = files.load(path)
        if "defaults" in loaded:
            raise NotPlain(str(path))
        _merge(cfg, {group: loaded})
        chosen[group] = option
    for key, value in values:
        _update(cfg, key, value)
    return cfg, chosen


def compose_plain(overrides: Sequence[str], config_name: str,
                  without_hydra_node: bool = False) -> tuple[Any, dict[str, str]] | None:
    """``compose_config(overrides, config_name)`` without Hydra, for a primary config whose defaults
    are ``group: option`` entries and ``_self_`` and overrides that are ``group=option`` or a plain
    ``key=value`` (``plain_value``): the same config (the groups merged in the defaults' order, struct
    mode, then each value set as Hydra's ``OmegaConf.update(..., merge=True)`` does) and the group
    choices; None for anything else, which Hydra composes (and reports). Hydra's import and its
    composition take most of a small planner run's start-up
    (``tests/unit/config/test_compose_plain.py`` checks the equivalence). ``without_hydra_node``: the
    config as ``compose_config`` returns it without ``return_hydra_config``, so the primary config's
    ``hydra`` node and its overrides of Hydra's own groups (``override hydra/job_logging: none``),
    which only shape that node, are left out."""
    from omegaconf import OmegaConf

    try:
        data, chosen = _compose_data(overrides, config_name, without_hydra_node)
        if without_hydra_node:
            _register_hydra_now_resolver()
        cfg = OmegaConf.create(data)
        OmegaConf.set_struct(cfg, True)
        cfg = complete_model_config(cfg)   # as compose_config does
    except Exception:  # noqa: BLE001 - NotPlain or any error: Hydra composes it and names the problem
        return None
    return cfg, chosen


class PlainConfig(dict):
    """A composed config as nested dicts read like OmegaConf's (``cfg.planner.out``, ``cfg.model.get``)."""
    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _as_plain_config(value: Any) -> Any:
    """Nested ``PlainConfig``s; ``NotPlain`` for what OmegaConf would read differently from the YAML
    (an interpolation, ``???``)."""
    if isinstance(value, dict):
        return PlainConfig({key: _as_plain_config(item) for key, item in value.items()})
    if isinstance(value, list):
        return [_as_plain_config(item) for item in value]
    if isinstance(value, str) and ("${" in value or value == "???"):
        raise NotPlain(value)
    return value


def compose_plain_dicts(overrides: Sequence[str], config_name: str) -> tuple[PlainConfig, dict[str, str]] | None:
    """``compose_plain``'s config as ``OmegaConf.to_container`` would give it, without importing
    OmegaConf: for configs with no interpolation and no model read from its own files
    (``ModelFamily.config_from_files``); None for anything else (``compose_plain`` or Hydra)."""
    from models.registry import known_family

    try:
        data, chosen = _compose_data(overrides, config_name, without_hydra_node=False)
        cfg = _as_plain_config(data)
        model = cfg.get("model")
        family = known_family(model.get("name")) if isinstance(model, dict) else None
        if family is not None and family.config_from_files is not None:
            raise NotPlain("model files")
    except Exception:  # noqa: BLE001 - as compose_plain
        return None
    return cfg, chosen


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
    first = str(error).splitlines()[0] if str(error).strip() else type(error).__name__
    home = next((o for o in overrides if "=~" in o and o.partition("=")[2].startswith("~") and o in first), None)
    if home is not None:   # the shell expands ~ only at a word's start, and Hydra's grammar refuses it
        key, _, path = home.partition("=")
        return (f"{home}: the shell leaves '~' after 'key=' as it is, and an override value cannot start with it: "
                f"write {key}=$HOME{path[1:]}")
    return first


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
    import difflib

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
