"""In-memory copies of every rank's newest state on a peer node (``checkpoint.in_memory_every``), so a
lost node's steps since the last disk checkpoint are not done again (as Gemini and CheckFreq do).

Every N steps each rank serialises its state (weights and optimizer state under their global names,
tensor-parallel shards made dense: what a disk checkpoint holds) and keeps it in its own node's host
memory, and sends it to the rank at the same place on the next node, which keeps it in its node's
host memory too. The ranks are restarted on every re-form, so the copies live outside them, as files
in ``/dev/shm/pipedream-<run>/node<K>/`` (RAM), one folder per node (``launcher.node_rank``): several
"nodes" on one machine share /dev/shm, and the folder of a node that is not in the new world counts as
lost with it. A node's launcher clears its folder when it starts (a returning machine lost its memory).

On a (re)start, before the disk checkpoint is read, the ranks pool what the nodes present hold: when
every rank of a snapshot newer than the newest disk checkpoint is held somewhere, the holders write
it as an ordinary checkpoint (DCP, committed with its marker), which then resumes and reshards into
the new layout like any other. Otherwise (a snapshot's only copies were on lost nodes) the disk
checkpoint is used.
"""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from pipedream.checkpoint.integrity import MARKER, manifest
from pipedream.checkpoint.memory_folders import node_folder, node_of_this_rank
from pipedream.checkpoint.plain import load_plain
from pipedream.checkpoint.store import (OPTIONS, _dense_state, _whole_parameters, _with_tied_aliases,
                                        _written_everywhere, complete_checkpoints, step_dir)

def _name(step: int, world: int, rank: int) -> str:
    return f"step{step:08d}-of{world}-rank{rank}.pt"


def _held(folder: Path) -> dict[tuple[int, int], set[int]]:
    """(step, world size) -> the ranks whose copies this folder holds."""
    found: dict[tuple[int, int], set[int]] = {}
    for path in folder.glob("step*-of*-rank*.pt") if folder.exists() else []:
        step, world, rank = (int(part.lstrip("stepofrank")) for part in path.stem.split("-"))
        found.setdefault((step, world), set()).add(rank)
    return found


class PeerCopies:
    """One rank's side: snapshots after steps, and the recovery at start."""

    def __init__(self, every: int, run_dir: Path, rank: int, world: int, local_world: int, module: Any, engine: Any,
                 group: Any):
        self.every, self.run_dir, self.rank, self.world = every, run_dir, rank, world
        self.module, self.engine, self.group = module, engine, group
        self.node = node_of_this_rank()
        self.folder = node_folder(run_dir, self.node)
        self.peer_to = (rank + local_world) % world     # the same place on the next node
        self.peer_from = (rank - local_world) % world

    def _state_bytes(self) -> bytes:
        optimizer = self.engine.optimizer
        _whole_parameters(optimizer)
        state = {"model": get_model_state_dict(self.module, options=OPTIONS),
                 "optim": get_optimizer_state_dict(self.module, optimizer, options=OPTIONS)}
        if self.engine.tp is not None and self.engine.tp.size > 1:
            state = _dense_state(state, self.module, self.engine.tp)
        state["optim"] = _with_tied_aliases(state["optim"], self.module)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    def after_step(self, step: int) -> None:
        """Collective every ``every`` steps: this rank's copy here and on the next node."""
        if self.every <= 0 or step % self.every:
            return
        own = self._state_bytes()
        received = self._exchange(own) if self.peer_to != self.rank else None
        self.folder.mkdir(parents=True, exist_ok=True)
        self._write(_name(step, self.world, self.rank), own)
        if received is not None:
            self._write(_name(step, self.world, self.peer_from), received)
        for path in self.folder.glob("step*.pt"):   # only the newest snapshot is kept
            if not path.name.startswith(f"step{step:08d}-"):
                path.unlink(missing_ok=True)

    def _write(self, name: str, data: bytes) -> None:
        partial = self.folder / (name + ".partial")
        partial.write_bytes(data)
        partial.rename(self.folder / name)   # whole or absent

    def _exchange(self, data: bytes) -> bytes:
        """Sends ``data`` to the next node's rank and returns what the previous node's rank sent."""
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
        incoming = torch.empty(int(sizes[self.peer_from].item()), dtype=torch.uint8)
        outgoing = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        works = [dist.isend(outgoing, self.peer_to, group=self.group),
                 dist.irecv(incoming, self.peer_from, group=self.group)]
        for work in works:
            work.wait()
        return incoming.numpy().tobytes()

    def recover(self, checkpoint_root: Path, extra: dict[str, Any]) -> int | None:
        """Collective, before resuming: writes the newest complete in-memory snapshot that is newer
        than every disk checkpoint as a committed checkpoint; returns its step, or None."""
        held = {key: sorted(ranks) for key, ranks in _held(self.folder).items()}
        pooled: list[Any] = [None] * self.world
        dist.all_gather_object(pooled, (self.node, self.rank, held), group=self.group)
        disk = complete_checkpoints(checkpoint_root)
        newest_disk = int(json.loads((disk[-1] / MARKER).read_text())["step"]) if disk else 0
        chosen = _choose(pooled, newest_disk)
        if chosen is None:
            return None
        (step, world), readers = chosen
        state: dict[str, Any] = {"model": {}, "optim": {}}
        for old_rank in readers.get(self.rank, []):
            part = load_plain(self.folder / _name(step, world, old_rank))
            state["model"].update(part["model"])
            state["optim"].update(part["optim"])
        root = checkpoint_root
        final = step_dir(root, step)
        partial = final.with_name(final.name + ".partial")

        def start() -> None:
            if self.rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True, exist_ok=True)

        def write() -> None:
            dcp.save(state, checkpoint_id=str(partial))

        def commit() -> None:
            if self.rank == 0:
                shutil.rmtree(final, ignore_errors=True)
                partial.rename(final)
                (final / "extra.json").write_text(json.dumps({**extra, "step": step, "from_memory": True},
                                                             indent=1, default=str))
                (final / MARKER).write_text(json.dumps({"step": step, **manifest(final, MARKER)}))

        for phase, written in ((start, (partial,)), (write, (partial,)), (commit, (partial, final))):
            _written_everywhere(phase, root, written, self.rank)
        dist.barrier(group=self.group)
        if self.rank == 0:
            print(f"elastic: step {step} recovered from in-memory copies on nodes "
                  f"{sorted({node for node, _, _ in pooled})} (newest disk checkpoint: step {newest_disk})",
                  flush=True)
        return step


def _choose(pooled: list[Any], newest_disk: int) -> tuple[tuple[int, int], dict[int, list[int]]] | None:
    """The newest snapshot after ``newest_disk`` whose every rank is held on a node present, and which
    new rank reads which old rank's copy (the lowest new rank of the first node holding it)."""
    holders: dict[tuple[int, int], dict[int, int]] = {}   # snapshot -> old rank -> reading new rank
    for node, rank, held in sorted(pooled):
        for key, ranks in held.items():
            for old_rank in ranks:
                holders.setdefault(tuple(key), {}).setdefault(old_rank, rank)
    for (step, world), readers in sorted(holders.items(), reverse=True):
        if step > newest_disk and set(readers) == set(range(world)):
            by_reader: dict[int, list[int]] = {}
            for old_rank, reader in sorted(readers.items()):
                by_reader.setdefault(reader, []).append(old_rank)
            return (step, world), by_reader
    return None
