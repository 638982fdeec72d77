"""The host and device tiers (pipedream.offload): copies, byte counters, resident accounting and
the budget, on CPU (where both tiers are RAM)."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from pipedream.offload import host as host_module
from pipedream.offload import DeviceBudgetError, DeviceTier, Direction, HostTier, SwapCounters, TensorClass

W, G, A = TensorClass.WEIGHTS, TensorClass.GRADIENTS, TensorClass.ACTIVATIONS
H2D, D2H, D2D = Direction.HOST_TO_DEVICE, Direction.DEVICE_TO_HOST, Direction.DEVICE_TO_DEVICE


def tiers(budget=None, shared_dir=None):
    host = HostTier(shared_dir)
    host.put(("w", 0), torch.arange(6, dtype=torch.float32).view(2, 3))   # 24 bytes
    host.put(("w", 1), torch.ones(4))                                      # 16 bytes
    return host, DeviceTier(host, "cpu", budget)


def test_swap_in_copies_and_counts_host_to_device_bytes():
    host, device = tiers()
    weight = device.swap_in(("w", 0), W)
    assert torch.equal(weight, host.get(("w", 0)))
    assert weight.data_ptr() != host.get(("w", 0)).data_ptr()   # a copy, not a view of the master
    assert device.counters.bytes(W, H2D) == 24
    assert device.resident_bytes == 24
    device.swap_in(("w", 0), W)                                   # already resident: no second copy
    assert device.counters.bytes(W, H2D) == 24


def test_a_device_key_can_round_trip_through_another_host_key():
    # harmony_pp's stashes: one host slot per (task, micro-batch, shape) reused every iteration,
    # the device key per (task, micro-batch)
    host, device = tiers()
    device.adopt(("s", 2, 0), torch.full((2, 3), 5.0), A)
    device.swap_out(("s", 2, 0), host_key=("slot", 2, 0))
    assert ("s", 2, 0) not in host and torch.equal(host.get(("slot", 2, 0)), torch.full((2, 3), 5.0))
    back = device.swap_in(("s", 2, 0), A, host_key=("slot", 2, 0))
    assert torch.equal(back, torch.full((2, 3), 5.0)) and back.data_ptr() != host.get(("slot", 2, 0)).data_ptr()
    assert device.counters.bytes(A, D2H) == device.counters.bytes(A, H2D) == 24
    assert device.resident_bytes == 24


def test_swap_out_writes_back_or_drops():
    host, device = tiers()
    weight = device.swap_in(("w", 0), W)
    weight.add_(1.0)
    device.swap_out(("w", 0), write_back=False)                   # read-only use: the master is unchanged
    assert host.get(("w", 0))[0, 0].item() == 0.0
    assert device.counters.bytes(W, D2H) == 0 and device.resident_bytes == 0
    weight = device.swap_in(("w", 0), W)
    weight.add_(1.0)
    device.swap_out(("w", 0))
    assert host.get(("w", 0))[0, 0].item() == 1.0
    assert device.counters.bytes(W, D2H) == 24


def test_tensors_made_on_the_device_are_counted_and_written_to_a_new_host_key():
    host, device = tiers()
    grad = device.allocate(("g", 0), (2, 3), torch.float32, G)
    grad.fill_(2.0)
    assert device.resident_bytes == 24
    device.swap_out(("g", 0))
    assert torch.equal(host.get(("g", 0)), torch.full((2, 3), 2.0))
    assert device.counters.bytes(G, D2H) == 24
    received = device.adopt(("act", 3), torch.zeros(5), A)
    assert device.resident_bytes == 20 and device.release(("act", 3)) is received
    assert device.resident_bytes == 0


def test_peak_resident_bytes_is_the_high_water_mark():
    _, device = tiers()
    device.swap_in(("w", 0), W)
    device.swap_in(("w", 1), W)
    device.swap_out(("w", 0), write_back=False)
    assert (device.resident_bytes, device.peak_resident_bytes) == (16, 40)
    device.reset_peak()
    assert device.peak_resident_bytes == 16


def test_the_budget_is_never_exceeded():
    _, device = tiers(budget=30)
    device.swap_in(("w", 0), W)
    with pytest.raises(DeviceBudgetError, match="exceed the device budget of 30 bytes"):
        device.swap_in(("w", 1), W)
    with pytest.raises(DeviceBudgetError):
        device.allocate(("g", 0), (2,), torch.float32, G)
    assert device.resident_bytes == 24 and device.peak_resident_bytes == 24
    device.swap_out(("w", 0), write_back=False)
    device.swap_in(("w", 1), W)                                   # fits once the first one left
    assert device.peak_resident_bytes == 24


def test_prefetch_only_when_it_fits_and_swap_in_then_uses_it():
    _, device = tiers(budget=30)
    device.swap_in(("w", 0), W)
    assert device.prefetch(("w", 1), W) is False                  # 24 + 16 > 30: left to the swap-in
    assert device.counters.bytes(W, H2D) == 24
    device.swap_out(("w", 0), write_back=False)
    assert device.prefetch(("w", 1), W) is True
    assert device.prefetch(("w", 1), W) is False                  # already there
    assert torch.equal(device.swap_in(("w", 1), W), torch.ones(4))
    assert device.counters.bytes(W, H2D) == 24 + 16               # prefetch counted once


def test_device_to_device_and_counter_intervals():
    _, device = tiers()
    before = device.counters.snapshot()
    device.swap_in(("w", 1), W)
    device.record_device_to_device(A, 100)
    interval = device.counters.since(before)
    assert interval.bytes(W, H2D) == 16 and interval.bytes(A, D2D) == 100
    table = interval.as_dict()
    assert table["activations"]["device_to_device"] == 100 and table["optimizer_state"]["host_to_device"] == 0
    assert interval.total() == 116 and interval.total(W) == 16
    with pytest.raises(ValueError):
        SwapCounters().add(W, H2D, -1)


def test_errors_name_the_key():
    _, device = tiers()
    with pytest.raises(KeyError, match="not on the device"):
        device.swap_out(("w", 0))
    with pytest.raises(KeyError, match="host tier holds no tensor"):
        device.swap_in(("w", 9), W)
    device.swap_in(("w", 0), W)
    with pytest.raises(KeyError, match="already on the device"):
        device.adopt(("w", 0), torch.zeros(1), W)
    with pytest.raises(ValueError, match="must be > 0"):
        DeviceTier(HostTier(), "cpu", 0)


def test_shared_host_tier_is_one_copy_for_every_mapping(tmp_path):
    writer, device = tiers(shared_dir=tmp_path)
    reader = HostTier(tmp_path)
    mapped = reader.allocate(("w", 0), (2, 3), create=False)      # another process would do this
    assert torch.equal(mapped, writer.get(("w", 0)))
    weight = device.swap_in(("w", 0), W)
    weight.mul_(10.0)
    device.swap_out(("w", 0))
    assert mapped[0, 1].item() == 10.0                            # the write-back is seen through the other mapping
    with pytest.raises(FileNotFoundError):
        reader.allocate(("missing",), (1,), create=False)
    writer.remove_files()
    assert not list(tmp_path.iterdir())


def test_remove_drops_one_key_and_its_shared_file(tmp_path):
    host = HostTier(tmp_path)
    host.put(("a", 0), torch.ones(3))
    host.put(("b", 0), torch.zeros(2))
    assert len(list(tmp_path.iterdir())) == 2
    host.remove(("a", 0))
    assert ("a", 0) not in host and ("b", 0) in host
    assert [p.name for p in tmp_path.iterdir()] == ["b_0.bin"]
    assert host.resident_bytes() == 8
    host.remove(("a", 0))   # removing what is gone is a no-op


class FakeCudart:
    """Records page-locking calls (the CPU wheel has no CUDA runtime); ``refuse`` fails them."""

    def __init__(self, refuse: bool = False) -> None:
        self.calls: list[tuple] = []
        self.refuse = refuse

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes, flags))
        return 1 if self.refuse else 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


def pinned_shared_tier(monkeypatch, tmp_path, cudart, filesystem="tmpfs"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(host_module, "filesystem_type", lambda path: filesystem)
    return HostTier(tmp_path, pin=True)


def test_the_filesystem_of_a_path_is_its_longest_mount_point(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("overlay / overlay rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n/dev/sda1 /dev/shmem ext4 rw 0 0\n")
    assert host_module.filesystem_type(Path("/dev/shm/harmony"), str(mounts)) == "tmpfs"
    assert host_module.filesystem_type(Path("/dev/shmem/x"), str(mounts)) == "ext4"
    assert host_module.filesystem_type(Path("/work"), str(mounts)) == "overlay"
    assert host_module.filesystem_type(Path("/work"), str(tmp_path / "absent")) is None


def test_a_folder_on_disk_is_never_offered_to_cuda_and_stays_pageable(monkeypatch, tmp_path):
    cudart = FakeCudart()
    host = pinned_shared_tier(monkeypatch, tmp_path, cudart, filesystem="ext4")
    with pytest.warns(UserWarning, match="not tmpfs"):
        host.allocate("a", (4,))
    host.allocate("b", (4,))
    host.remove_files()
    assert cudart.calls == [] and not host.pin


def test_a_pinned_shared_tier_page_locks_each_mapping_until_it_lets_go(monkeypatch, tmp_path):
    cudart = FakeCudart()
    host = pinned_shared_tier(monkeypatch, tmp_path, cudart)
    a = host.allocate("a", (4, 2))
    b = host.allocate("b", (3,))
    assert cudart.calls == [("register", a.data_ptr(), 32, 1), ("register", b.data_ptr(), 12, 1)]
    again = host.allocate("a", (4, 2), create=False)   # mapped again: the old mapping is let go first
    assert cudart.calls[2:] == [("unregister", a.data_ptr()), ("register", again.data_ptr(), 32, 1)]
    host.remove("b")
    assert cudart.calls[-1] == ("unregister", b.data_ptr())
    host.remove_files()
    assert cudart.calls[-1] == ("unregister", again.data_ptr()) and len(cudart.calls) == 6


def test_where_cuda_refuses_to_pin_the_tier_warns_once_and_goes_on_pageable(monkeypatch, tmp_path):
    cudart = FakeCudart(refuse=True)
    host = pinned_shared_tier(monkeypatch, tmp_path, cudart)
    with pytest.warns(UserWarning, match="stays pageable"):
        host.allocate("a", (4,))
    host.allocate("b", (4,))
    host.remove_files()
    assert [c[0] for c in cudart.calls] == ["register"] and not host.pin


@pytest.mark.gpu
def test_on_cuda_a_shared_mapping_is_page_locked_and_prefetched_asynchronously():
    shared = Path(tempfile.mkdtemp(dir="/dev/shm"))   # CUDA page-locks shared memory, not files on disk
    host = HostTier(shared, pin=True)
    source = host.put(("w", 0), torch.arange(1 << 16, dtype=torch.float32))
    assert source.is_pinned()
    device = DeviceTier(host, torch.device("cuda"), None)
    assert device.prefetch(("w", 0), W)
    assert torch.equal(device.swap_in(("w", 0), W).cpu(), torch.arange(1 << 16, dtype=torch.float32))
    host.remove_files()
    shared.rmdir()
