"""Where in-memory copies of rank states live (torch-free: the launcher clears its node's folder):
``/dev/shm/pipedream-<run>/node<K>/``, host memory, one folder per node (pipedream/checkpoint/peer_copies.py)."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

NODE_ENV = "PIPEDREAM_NODE"   # launcher.node_rank, set by the launcher for its agent and ranks
SHM = Path("/dev/shm")


def node_of_this_rank() -> int:
    return int(os.environ.get(NODE_ENV) or os.environ.get("GROUP_RANK") or 0)


def memory_root(run_dir: Path) -> Path:
    return SHM / f"pipedream-{hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]}"


def node_folder(run_dir: Path, node: int) -> Path:
    return memory_root(run_dir) / f"node{node}"


def clear_node(run_dir: Path, node: int) -> None:
    """A node (re)starting: whatever its folder held is gone, as a restarted machine's memory is."""
    shutil.rmtree(node_folder(run_dir, node), ignore_errors=True)


def clear_all(run_dir: Path) -> None:
    """At the end of the run: no copy is left in memory."""
    shutil.rmtree(memory_root(run_dir), ignore_errors=True)
