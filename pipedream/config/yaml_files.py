"""The YAML files of a plain composition (``loading.compose_plain``): read with OmegaConf's rules
without importing OmegaConf, and their parsed values cached next to them."""
from __future__ import annotations

import marshal
import os
import re
import sys
from pathlib import Path
from typing import Any


class NotPlain(Exception):
    """An override or config outside what ``compose_plain`` reproduces: Hydra composes it."""


# OmegaConf's YAML rules (``omegaconf._utils.get_yaml_loader``), restated so that a plain composition
# need not import OmegaConf (a tenth of a small planner run): YAML 1.2 floats (1e5, not only 1.0e+5),
# no timestamps. tests/unit/config/test_compose_plain.py checks that they equal OmegaConf's.
_YAML_FLOAT = re.compile(r"""^(?:
         [-+]?[0-9]+(?:_[0-9]+)*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9]+(?:_[0-9]+)*(?:[eE][-+]?[0-9]+)
        |\.[0-9]+(?:_[0-9]+)*(?:[eE][-+][0-9]+)?
        |[-+]?[0-9]+(?:_[0-9]+)*(?::[0-5]?[0-9])+\.[0-9_]*
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""", re.X)


def yaml_loader() -> Any:
    """PyYAML's safe loader with OmegaConf's float and timestamp rules, duplicate keys refused (Hydra
    reports them), on libyaml's parser where PyYAML has it: the values OmegaConf reads, parsed
    several times faster."""
    import yaml

    class Loader(yaml.CSafeLoader if getattr(yaml, "__with_libyaml__", False) else yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            keys = [k.value for k, _ in node.value if k.tag == yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG]
            if len(keys) != len(set(keys)):
                raise NotPlain("duplicate key")
            return super().construct_mapping(node, deep=deep)

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML_FLOAT, list("-+0123456789."))
    Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in Loader.yaml_implicit_resolvers.items()}
    return Loader


class ConfigFiles:
    """The YAML files of one composition: parsed with ``yaml_loader``, or their values as parsed
    before, cached next to the files (``conf/__pycache__``, written where Python writes bytecode: not
    under ``PYTHONDONTWRITEBYTECODE``) and taken only while a file's text is the one parsed. PyYAML's
    import and parsing were a twentieth of a small planner run."""

    FORMAT = 1   # raise when yaml_loader's rules change: values parsed under older rules are not reused

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / "__pycache__" / f"yaml-values.{sys.implementation.cache_tag}.{self.FORMAT}.marshal"
        self.loader: Any = None
        self.changed = False
        try:
            cached = marshal.loads(self.path.read_bytes())
        except (OSError, EOFError, ValueError, TypeError):
            cached = {}
        self.cached: dict = cached if isinstance(cached, dict) else {}

    def load(self, path: Path) -> dict:
        text = path.read_text()
        if "@package" in text:   # Hydra's package header moves the config: Hydra's job
            raise NotPlain(str(path))
        key = str(path.relative_to(self.root))
        entry = self.cached.get(key)
        if isinstance(entry, tuple) and len(entry) == 2 and entry[0] == text:
            data = marshal.loads(entry[1])   # a fresh copy: the composition merges into it
        else:
            import yaml

            self.loader = self.loader or yaml_loader()
            data = yaml.load(text, Loader=self.loader)
            try:
                self.cached[key] = (text, marshal.dumps(data))
                self.changed = True
            except ValueError:   # a value marshal cannot write (an explicit !!timestamp): parsed each time
                pass
        if not isinstance(data, dict):
            raise NotPlain(str(path))
        return data

    def save(self) -> None:
        """Writes the values parsed this time (a read-only or shared folder: nothing is cached)."""
        if not self.changed or sys.dont_write_bytecode:
            return
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}")
        try:
            self.path.parent.mkdir(exist_ok=True)
            partial.write_bytes(marshal.dumps(self.cached))
            os.replace(partial, self.path)   # atomic: runs started at once read one whole file or the other
        except OSError:
            partial.unlink(missing_ok=True)
