"""Whether NVIDIA apex can serve ``optim.impl=apex`` here, checked before any process starts and
without torch: apex's ``optimizers/fused_adam.py`` must lie beside the importable package (the
unrelated registry package named ``apex`` has no such file). Its kernels: ``pipedream.numerics.apex``."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from pipedream.errors import ConfigError

APEX_HINT = ("install NVIDIA apex from https://github.com/NVIDIA/apex (with its CUDA extensions), "
             "or use optim.impl=torch")


def apex_installed() -> bool:
    spec = importlib.util.find_spec("apex")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any((Path(place) / "optimizers" / "fused_adam.py").is_file() for place in spec.submodule_search_locations)


def check_apex(impl: str, device: str) -> None:
    """One line before launch when ``optim.impl=apex`` cannot run here."""
    if impl != "apex":
        return
    if not apex_installed():
        raise ConfigError(f"optim.impl=apex, but NVIDIA apex is not importable: {APEX_HINT}")
    if device == "cpu":
        raise ConfigError("optim.impl=apex needs cluster.device=cuda (apex's fused kernels are CUDA only): "
                          "use optim.impl=torch on CPU")
