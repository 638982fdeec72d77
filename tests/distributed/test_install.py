"""A non-editable ``pip install .`` works from any directory: the Hydra configs ship as the ``conf``
package next to ``pipedream``, and every entry point finds them there."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "pipedream", "planner", "launcher", "models", "conf")
PACKAGES = ("conf", "launcher", "models", "pipedream", "planner")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The project installed by pip into a folder. Built from a copy of the sources, since pip builds
    in place (build/, *.egg-info); offline, with the environment's setuptools."""
    root = tmp_path_factory.mktemp("install")
    (root / "source").mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, root / "source" / name, ignore=skip)
        else:
            shutil.copy2(path, root / "source" / name)
    target = root / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", str(root / "source"), "--no-deps", "--no-build-isolation",
                    "--no-index", "--quiet", "--target", str(target)],
                   check=True, capture_output=True, timeout=120, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    return target


def run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python *args`` in ``cwd`` with only the installed copy on the path (not the checkout)."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result


def test_packages_and_configs_come_from_the_install(site, tmp_path):
    code = f"import {', '.join(PACKAGES)}; print('\\n'.join(m.__file__ for m in ({', '.join(PACKAGES)})))"
    files = run_installed(site, tmp_path, "-c", code).stdout.split()
    assert [Path(f).parent for f in files] == [site / name for name in PACKAGES]
    for name in ("config.yaml", "planner.yaml", "model/gpt_tiny.yaml", "cluster/local_cpu.yaml"):
        assert (site / "conf" / name).is_file()


def test_planner_dry_run(site, tmp_path):
    out = run_installed(site, tmp_path, "-m", "planner", "model=gpt_tiny", "cluster=local_cpu",
                        "train.global_batch_size=16", "planner.out=plan.json").stdout
    assert "wrote plan.json" in out and (tmp_path / "plan.json").is_file()


def test_launcher_dry_run(site, tmp_path):
    out = run_installed(site, tmp_path, "-m", "launcher", "launcher.dry_run=true", "parallel.pp=2").stdout
    assert "--nproc-per-node=2" in out and "-m pipedream.train" in out
    assert not (tmp_path / "outputs").exists()


def test_training_entry_point_composes_its_config(site, tmp_path):
    """``@hydra.main`` of ``pipedream.train`` (what torchrun runs) finds the installed configs."""
    out = run_installed(site, tmp_path, "-m", "pipedream.train", "--cfg", "job", "model=mlp").stdout
    assert "name: mlp" in out and "global_batch_size:" in out
