"""Plugin models and datasets in the config, torch-free: ``model._target_=my_pkg.mod.build`` (and
``data._target_=...``) names any importable callable, Hydra's ``_target_`` convention; the other
keys of the section are its keyword arguments (``models.plugins`` calls it).

On the command line a plugin replaces the section's preset: ``plugin_overrides`` turns
``model._target_=x model.width=64`` into Hydra's ``~model ++model._target_=x ++model.width=64``
(drop the default preset, add the keys), so users need not spell Hydra's append syntax.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence


TARGET = "_target_"
PLUGIN_SECTIONS = ("model", "data")


def plugin_target(section: Any) -> str | None:
    """The ``_target_`` of a config section (``cfg.model`` / ``cfg.data``), or None for a preset."""
    if not isinstance(section, Mapping) and not hasattr(section, "get"):
        return None
    target = section.get(TARGET)
    return str(target) if target is not None else None


def plugin_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides with each plugin section's keys as additions to an emptied section; unchanged
    when no ``<section>._target_`` is given or the user already chose a preset (``model=...``)."""
    out = list(overrides)
    for section in PLUGIN_SECTIONS:
        keys = [o for o in out if o.lstrip("+").startswith(f"{section}.")]
        chose = any(re.match(rf"^(\+{{0,2}}{section}|~{section})(=|$)", o) for o in out)
        if chose or not any(o.lstrip("+").startswith(f"{section}.{TARGET}=") for o in keys):
            continue
        out = [f"~{section}"] + [f"++{o.lstrip('+')}" if o in keys else o for o in out]
    return out
