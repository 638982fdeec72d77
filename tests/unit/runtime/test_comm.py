"""PipeComm without a process group: torch.distributed's point-to-point calls are replaced by a
recorder, so tags, peers, the group of each direction, buffer shapes and the scatter/gather
slicing are checked on what PipeComm asks the transport to do."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pipedream.runtime.comm import TAG_SPACE, PipeComm, message_tag
from pipedream.runtime.groups import DirectedGroups
from pipedream.config.layout import ParallelLayout
from models.tensor_parallel import TensorParallel

TIMEOUT = timedelta(seconds=3)
UP, DOWN, TP_GROUP = "to-higher", "to-lower", "tp"   # stand-ins for process groups: only compared


@dataclass
class Call:
    op: str            # "send" or "recv"
    peer: int
    group: object
    tag: int
    tensor: torch.Tensor


@dataclass
class FakeWork:
    on_wait: object = None
    waited_with: list = field(default_factory=list)

    def wait(self, timeout=None) -> bool:
        self.waited_with.append(timeout)
        if self.on_wait is not None:
            self.on_wait()
        return True


@dataclass
class Transport:
    """Records isend/irecv; a receive is filled with ``fill`` when waited on."""

    calls: list[Call] = field(default_factory=list)
    works: list[FakeWork] = field(default_factory=list)
    fill: float = 7.0

    def isend(self, tensor, dst, group=None, tag=0):
        self.calls.append(Call("send", dst, group, tag, tensor))
        self.works.append(FakeWork())
        return self.works[-1]

    def irecv(self, tensor, src, group=None, tag=0):
        self.calls.append(Call("recv", src, group, tag, tensor))
        self.works.append(FakeWork(on_wait=lambda: tensor.fill_(self.fill)))
        return self.works[-1]


@pytest.fixture
def transport(monkeypatch) -> Transport:
    fake = Transport()
    monkeypatch.setattr(dist, "isend", fake.isend)
    monkeypatch.setattr(dist, "irecv", fake.irecv)
    return fake


def make_comm(layout: ParallelLayout, rank: int, shape=(2, 3), **kwargs) -> PipeComm:
    def spec(microbatch: int, chunk: int):
        return torch.Size(shape), torch.float32

    return PipeComm(layout, rank, torch.device("cpu"), TIMEOUT, DirectedGroups(to_higher=UP, to_lower=DOWN),
                    input_spec=spec, output_spec=spec, **kwargs)


def test_message_tags_are_distinct_and_wrap():
    tags = {message_tag(mb, chunk, 3, is_grad) for mb in range(50) for chunk in range(3) for is_grad in (False, True)}
    assert len(tags) == 50 * 3 * 2
    assert message_tag(3, 1, 2, True) == ((3 * 2 + 1) * 2 + 1)
    assert message_tag(TAG_SPACE, 0, 1, False) == 0   # ids wrap inside the tag space


def test_activation_goes_up_and_gradient_comes_down(transport):
    layout = ParallelLayout(pp=2)
    first, second = make_comm(layout, 0), make_comm(layout, 1)
    activation = torch.arange(6.0).reshape(2, 3)
    first.send_activation(5, 0, activation)
    second.post_recv_activation(5, 0)
    second.post_recv_activation(5, 0)   # posting twice posts once
    send, recv = transport.calls
    assert (send.op, send.peer, send.group, send.tag) == ("send", 1, UP, message_tag(5, 0, 1, False))
    assert (recv.op, recv.peer, recv.group, recv.tag) == ("recv", 0, UP, send.tag)
    assert torch.equal(send.tensor, activation) and recv.tensor.shape == (2, 3)
    assert ((False, 5, 0) in second._recvs) and not ((True, 5, 0) in second._recvs)

    received = second.wait_activation(5, 0)
    assert torch.equal(received, torch.full((2, 3), 7.0)) and not ((False, 5, 0) in second._recvs)
    assert transport.works[1].waited_with == [TIMEOUT]

    second.send_gradient(5, 0, torch.ones(2, 3))
    first.post_recv_gradient(5, 0)
    grad_send, grad_recv = transport.calls[2:]
    assert (grad_send.peer, grad_send.group, grad_send.tag) == (0, DOWN, message_tag(5, 0, 1, True))
    assert (grad_recv.peer, grad_recv.group, grad_recv.tag) == (1, DOWN, grad_send.tag)
    assert first.stats.messages_sent == 1 and first.stats.bytes_sent == 6 * 4
    assert second.stats.bytes_received == 6 * 4


@pytest.mark.parametrize("pp,vpp,dp", [(2, 1, 1), (3, 1, 2), (2, 2, 1), (4, 2, 1)])
def test_every_send_meets_a_receive_with_the_same_peer_group_and_tag(transport, pp, vpp, dp):
    """Both ends of each boundary, for every virtual stage and a few micro-batches: the multiset of
    (src, dst, group, tag) is the same on the sending and on the receiving side."""
    layout = ParallelLayout(pp=pp, vpp=vpp, dp=dp)
    comms = [make_comm(layout, rank) for rank in range(layout.world_size)]
    sent, received = Counter(), Counter()
    for rank, comm in enumerate(comms):
        pp_rank = layout.coords(rank).pp
        for chunk in range(vpp):
            vs = layout.virtual_stage(pp_rank, chunk)
            for mb in range(3):
                before = len(transport.calls)
                if vs < layout.num_virtual_stages - 1:
                    comm.send_activation(mb, chunk, torch.zeros(2, 3))
                    comm.post_recv_gradient(mb, chunk)
                if vs > 0:
                    comm.send_gradient(mb, chunk, torch.zeros(2, 3))
                    comm.post_recv_activation(mb, chunk)
                for call in transport.calls[before:]:
                    if call.op == "send":
                        sent[(rank, call.peer, call.group, call.tag)] += 1
                    else:
                        received[(call.peer, rank, call.group, call.tag)] += 1
    assert sent == received
    assert sum(sent.values()) == 2 * (layout.num_virtual_stages - 1) * 3 * dp
    assert all(group == (UP if src < dst else DOWN) for src, dst, group, _ in sent)


def test_interleaved_tags_name_the_receiving_chunk(transport):
    """Rank 1's chunk 0 feeds rank 0's chunk 1: the tag carries chunk 1 on both ends."""
    layout = ParallelLayout(pp=2, vpp=2)
    make_comm(layout, 1).send_activation(4, 0, torch.zeros(2, 3))
    make_comm(layout, 0).post_recv_activation(4, 1)
    send, recv = transport.calls
    assert send.peer == 0 and send.group is DOWN and recv.peer == 1 and recv.group is DOWN
    assert send.tag == recv.tag == message_tag(4, 1, 2, False)


def test_wait_without_post_and_park_unpark(transport):
    comm = make_comm(ParallelLayout(pp=2), 1)
    with pytest.raises(RuntimeError, match="never posted"):
        comm.wait_activation(0, 0)
    comm.post_recv_activation(0, 0)
    parked = comm.park()
    assert not ((False, 0, 0) in comm._recvs) and list(parked) == [(False, 0, 0)]
    comm.post_recv_activation(9, 0)   # e.g. an evaluation between two asynchronous steps
    with pytest.raises(RuntimeError, match="still posted"):
        comm.unpark(parked)
    comm.wait_activation(9, 0)
    comm.unpark(parked)
    assert ((False, 0, 0) in comm._recvs)


def test_wait_sends_completes_every_send_once(transport):
    comm = make_comm(ParallelLayout(pp=2), 0)
    for mb in range(3):
        comm.send_activation(mb, 0, torch.zeros(2, 3))
    comm.wait_sends()
    comm.wait_sends()
    assert [work.waited_with for work in transport.works] == [[TIMEOUT]] * 3


def test_sent_tensor_is_made_contiguous(transport):
    comm = make_comm(ParallelLayout(pp=2), 0, shape=(3, 2))
    comm.send_activation(0, 0, torch.arange(6.0).reshape(2, 3).t())
    sent = transport.calls[0].tensor
    assert sent.is_contiguous() and torch.equal(sent, torch.arange(6.0).reshape(2, 3).t())


def test_scatter_gather_sends_one_slice_and_all_gathers_it(transport, monkeypatch):
    """Tensor-parallel rank 1 of 2 sends the second half of the flattened tensor; the receiver's
    buffer is that half, and the all-gather rebuilds the full shape."""
    full = torch.arange(12.0).reshape(2, 2, 3)
    tp = TensorParallel(group=TP_GROUP, rank=1, size=2)
    layout = ParallelLayout(pp=2, tp=2)
    sender, receiver = make_comm(layout, 1, (2, 2, 3), tp=tp, scatter_gather=True), \
        make_comm(layout, 3, (2, 2, 3), tp=tp, scatter_gather=True)

    def all_gather(outputs, chunk, group=None):
        assert group == TP_GROUP
        outputs[0].copy_(full.reshape(-1)[:6])   # what tensor-parallel rank 0 received
        outputs[1].copy_(chunk)

    monkeypatch.setattr(dist, "all_gather", all_gather)
    transport.fill = 0.0
    sender.send_activation(0, 0, full)
    receiver.post_recv_activation(0, 0)
    send, recv = transport.calls
    assert send.peer == 3 and torch.equal(send.tensor, full.reshape(-1)[6:])
    assert recv.peer == 1 and recv.tensor.shape == (6,)
    transport.works[1].on_wait = lambda: recv.tensor.copy_(send.tensor)
    assert torch.equal(receiver.wait_activation(0, 0), full)
    assert sender.stats.bytes_sent == 6 * 4


def test_scatter_gather_sends_whole_when_indivisible(transport, capsys):
    tp = TensorParallel(group=TP_GROUP, rank=0, size=2)
    comm = make_comm(ParallelLayout(pp=2, tp=2), 0, (3,), tp=tp, scatter_gather=True)
    for mb in range(2):
        comm.send_activation(mb, 0, torch.ones(3))
    assert [call.tensor.shape for call in transport.calls] == [(3,), (3,)]
    assert capsys.readouterr().out.count("does not split") == 1   # warned once


def test_connect_exchanges_one_probe_per_channel_in_global_order(transport):
    layout = ParallelLayout(pp=3)
    comm = make_comm(layout, 1)
    comm.connect()
    ops = [(call.op, call.peer, call.group) for call in transport.calls]
    # channels sorted by (src, dst): (0,1) (1,0) (1,2) (2,1)
    assert ops == [("recv", 0, UP), ("send", 0, DOWN), ("send", 2, UP), ("recv", 2, DOWN)]
    assert all(work.waited_with == [TIMEOUT] for work in transport.works)
