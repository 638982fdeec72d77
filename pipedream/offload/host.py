"""The host tier: master copies of tensors, by key, in process memory or in shared memory.

With ``shared_dir`` every tensor is a file in that folder mapped with ``torch.from_file(...,
shared=True)``: every process on the server that opens the same folder sees the same bytes, so any
process can swap a tensor in that another one wrote (one server's host memory, as Harmony uses it).
Who writes when is the caller's protocol; this class only allocates, maps and removes.
"""
from __future__ import annotations

import math
import os
import re
import warnings
from pathlib import Path
from typing import Hashable

import torch

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def _file_name(key: Hashable) -> str:
    parts = key if isinstance(key, tuple) else (key,)
    return _UNSAFE.sub("-", "_".join(str(p) for p in parts)) + ".bin"


_REGISTER_PORTABLE = 1   # cudaHostRegisterPortable: page-locked for every CUDA context


def filesystem_type(path: Path, mounts: str = "/proc/mounts") -> str | None:
    """The type of the filesystem that holds ``path`` (``tmpfs``, ``ext4``, ...), from the mount
    table; None where there is none (not Linux)."""
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    target, best, kind = str(Path(path).resolve()), "", None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def _cuda_call(name: str, *args) -> None:
    """A CUDA runtime call through torch (``cudaHostRegister``/``cudaHostUnregister``), checked."""
    code = int(getattr(torch.cuda.cudart(), name)(*args))
    if code != 0:
        raise RuntimeError(f"{name} failed with CUDA error {code}")


class HostTier:
    def __init__(self, shared_dir: str | os.PathLike | None = None, pin: bool = False):
        """``pin`` (CUDA only): page-locked host memory, so copies to the device can run
        asynchronously: process memory is allocated pinned, a shared-memory mapping is registered
        with CUDA (``cudaHostRegister``) and unregistered when this process lets go of it."""
        self.shared_dir = Path(shared_dir) if shared_dir is not None else None
        self.pin = pin and torch.cuda.is_available()
        self._tensors: dict[Hashable, torch.Tensor] = {}
        self._registered: set[Hashable] = set()   # shared mappings page-locked by this process

    def __contains__(self, key: Hashable) -> bool:
        return key in self._tensors

    def keys(self):
        return self._tensors.keys()

    def get(self, key: Hashable) -> torch.Tensor:
        try:
            return self._tensors[key]
        except KeyError:
            raise KeyError(f"host tier holds no tensor {key!r}") from None

    def allocate(self, key: Hashable, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32,
                 *, create: bool = True) -> torch.Tensor:
        """A host tensor for ``key`` (zeros when created). In shared memory ``create=False`` maps a
        file another process created (same shape and dtype) instead of truncating it."""
        shape = tuple(int(s) for s in shape)
        if self.shared_dir is None:
            tensor = torch.zeros(shape, dtype=dtype, pin_memory=self.pin)
        else:
            path = self.shared_dir / _file_name(key)
            numel = math.prod(shape)
            if create:
                self.shared_dir.mkdir(parents=True, exist_ok=True)
                with open(path, "wb") as f:  # zero-filled, the full size, before anyone maps it
                    f.truncate(numel * torch.empty((), dtype=dtype).element_size())
            elif not path.exists():
                raise FileNotFoundError(f"shared host tensor {key!r} does not exist at {path}")
            tensor = torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)
            if self.pin and tensor.nbytes:
                self.forget(key)   # a key mapped again: the old mapping goes first
                self._register(key, tensor)
        self._tensors[key] = tensor
        return tensor

    def _register(self, key: Hashable, tensor: torch.Tensor) -> None:
        """Page-lock a shared mapping; where CUDA refuses, the tier goes on unpinned (copies are then
        staged by the driver: slower, not wrong) and says so once. CUDA page-locks shared memory
        (tmpfs) but refuses a mapping of a file on disk, and its refusal would stay behind as the
        next CUDA call's error, so a disk-backed folder is not offered to it at all."""
        kind = filesystem_type(self.shared_dir)
        if kind not in (None, "tmpfs"):
            warnings.warn(f"shared host memory in {self.shared_dir} ({kind}, not tmpfs) stays pageable: "
                          f"host-device copies will not overlap compute; put it under /dev/shm", stacklevel=3)
            self.pin = False
            return
        try:
            _cuda_call("cudaHostRegister", tensor.data_ptr(), tensor.nbytes, _REGISTER_PORTABLE)
        except RuntimeError as error:
            warnings.warn(f"shared host memory stays pageable ({error}): host-device copies will not "
                          f"overlap compute", stacklevel=3)
            self.pin = False
            return
        self._registered.add(key)

    def put(self, key: Hashable, value: torch.Tensor, *, create: bool = True) -> torch.Tensor:
        """Allocate ``key`` with ``value``'s shape and dtype and copy ``value`` into it."""
        tensor = self.allocate(key, value.shape, value.dtype, create=create)
        tensor.copy_(value.detach())
        return tensor

    def unlink(self, key: Hashable) -> None:
        """Remove ``key``'s shared-memory file but keep this process's mapping (the memory lives
        until every process that mapped it lets go): no file outlives the run."""
        if self.shared_dir is not None:
            (self.shared_dir / _file_name(key)).unlink(missing_ok=True)

    def forget(self, key: Hashable) -> None:
        """Drop this process's reference to ``key`` (its memory goes once nothing else holds it)."""
        tensor = self._tensors.pop(key, None)
        if key in self._registered:
            self._registered.discard(key)
            _cuda_call("cudaHostUnregister", tensor.data_ptr())

    def remove(self, key: Hashable) -> None:
        """Remove ``key`` from this tier: its shared-memory file (if any) and this process's reference."""
        self.unlink(key)
        self.forget(key)

    def resident_bytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    def remove_files(self) -> None:
        """Delete this tier's shared-memory files (call once, from one process, after the others
        are done); a process-memory tier just forgets its tensors."""
        for key in list(self._tensors):
            if self.shared_dir is not None:
                (self.shared_dir / _file_name(key)).unlink(missing_ok=True)
            self.forget(key)
