"""Ring attention over gloo ranks equals plain attention over the whole sequence: output and the
gradients of q, k and v, at cp=4 (the world), cp=2 (two pairs, so group ranks differ from global
ones) and cp=1 (groups of one, with no point-to-point at all), in float32 and bfloat16.

One set of four processes computes every case (starting them is the slow part); each rank gathers
its group's shards back to global order and returns them beside its own single-process reference."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from models.context_parallel import RingExchange, gather_zigzag, ring_attention, split_zigzag
from tests.support.workers import run_workers

BATCH, HEADS, KV_HEADS, SEQ, DIM = 2, 4, 2, 32, 8   # SEQ divisible by 2·cp for cp = 1, 2, 4
WORLD = 4
P2P_CALLS = ("batch_isend_irecv", "isend", "irecv", "send", "recv")


def reference_attention(q, k, v, causal: bool) -> torch.Tensor:
    """softmax(QKᵀ/√d)·V written out, kv heads repeated to the query heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores.softmax(-1) @ v


def global_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """q, k, v and the upstream gradient, the same on every rank."""
    gen = torch.Generator().manual_seed(0)
    query, key = (BATCH, HEADS, SEQ, DIM), (BATCH, KV_HEADS, SEQ, DIM)
    shapes = [query, key, key, query]
    return [torch.randn(shape, generator=gen).to(dtype) for shape in shapes]


class RecordingExchange(RingExchange):
    """The ring transport, noting the shape and dtype of every tensor it sends."""

    def __init__(self, group):
        super().__init__(group)
        self.sent: list[tuple[tuple[int, ...], torch.dtype]] = []

    def start(self, tensor):
        self.sent.append((tuple(tensor.shape), tensor.dtype))
        return super().start(tensor)


def _case(group, dtype: torch.dtype, causal: bool) -> dict:
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, grad_out = global_inputs(dtype)
    shards = [split_zigzag(t, cp, rank, 2).requires_grad_() for t in (q, k, v)]
    exchange = RecordingExchange(group)
    out = ring_attention(*shards, group, causal=causal, exchange=exchange)
    forward_sends = len(exchange.sent)
    out.backward(split_zigzag(grad_out, cp, rank, 2))
    got = [gather_zigzag(t, group, 2) for t in (out.detach(), *(s.grad for s in shards))]
    # the float32 reference from the very same (possibly bf16-rounded) inputs
    inputs = [t.float().requires_grad_() for t in (q, k, v)]
    expected_out = reference_attention(*inputs, causal)
    expected_out.backward(grad_out.float())
    expected = [expected_out.detach(), *(t.grad for t in inputs)]
    return {"cp": cp, "got": got, "expected": expected, "sent": exchange.sent, "forward_sends": forward_sends}


def _without_p2p(group) -> dict:
    """The cp=1 case with every point-to-point call of torch.distributed made to fail."""
    def refuse(*args, **kwargs):
        raise AssertionError("cp=1 made a point-to-point call")
    saved = {name: getattr(dist, name) for name in P2P_CALLS}
    try:
        for name in P2P_CALLS:
            setattr(dist, name, refuse)
        return _case(group, torch.float32, causal=True)
    finally:
        for name, call in saved.items():
            setattr(dist, name, call)


def _worker(rank: int, world_size: int) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        # every rank creates every group, in the same order
        pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
        single = [dist.new_group([r]) for r in range(world_size)][rank]
        world = dist.group.WORLD
        return {"cp4_fp32_causal": _case(world, torch.float32, True),
                "cp4_fp32_full": _case(world, torch.float32, False),
                "cp4_bf16_causal": _case(world, torch.bfloat16, True),
                "cp2_fp32_causal": _case(pair, torch.float32, True),
                "cp2_fp32_full": _case(pair, torch.float32, False),
                "cp2_bf16_causal": _case(pair, torch.bfloat16, True),
                "cp1_fp32_causal": _without_p2p(single)}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, WORLD, timeout=120)


NAMES = ("out", "grad_q", "grad_k", "grad_v")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["cp4_fp32_causal", "cp4_fp32_full", "cp2_fp32_causal", "cp2_fp32_full",
                                  "cp1_fp32_causal"])
def test_float32_matches_plain_attention(results, case):
    for rank, result in enumerate(results):
        for name, got, expected in zip(NAMES, result[case]["got"], result[case]["expected"]):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, expected, rtol=0, atol=5e-6,
                                       msg=lambda m: f"rank {rank} {case} {name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["cp4_bf16_causal", "cp2_bf16_causal"])
def test_bfloat16_matches_the_float32_reference_of_the_same_inputs(results, case):
    for rank, result in enumerate(results):
        for name, got, expected in zip(NAMES, result[case]["got"], result[case]["expected"]):
            assert got.dtype == torch.bfloat16
            # the same inputs and float32 compute: only the final rounding to bf16 (2^-8 relative) differs
            torch.testing.assert_close(got.float(), expected, rtol=8e-3, atol=1e-3,
                                       msg=lambda m: f"rank {rank} {case} {name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["cp4_fp32_causal", "cp2_fp32_causal", "cp4_bf16_causal"])
def test_only_kv_heads_wide_keys_and_values_travel(results, case):
    local = (2, BATCH, KV_HEADS, SEQ // results[0][case]["cp"], DIM)   # k and v stacked: one message a step
    for result in results:
        found = result[case]
        cp, sent, forward = found["cp"], found["sent"], found["forward_sends"]
        assert all(shape == local for shape, _ in sent), sent
        assert forward == cp - 1
        input_dtype = torch.bfloat16 if "bf16" in case else torch.float32
        assert all(dtype == input_dtype for _, dtype in sent[:forward])   # k, v travel in their own dtype
        # backward: the keys again (cp-1 steps) and the gradient accumulators (cp hops, home at the end)
        assert len(sent) - forward == (cp - 1) + cp


@pytest.mark.slow
def test_cp1_sends_nothing(results):
    assert all(result["cp1_fp32_causal"]["sent"] == [] for result in results)


# single-process checks (no workers): the test process has no process group, so group=None is cp=1

@pytest.mark.slow
def test_without_a_process_group_it_is_plain_causal_attention():
    q, k, v, _ = global_inputs(torch.float32)
    torch.testing.assert_close(ring_attention(q, k, v, None), reference_attention(q, k, v, causal=True),
                               rtol=0, atol=5e-6)


@pytest.mark.slow
@pytest.mark.parametrize("q_shape, kv_shape, rule", [
    ((2, 4, 15, 8), (2, 2, 15, 8), "local sequence length 15 is odd"),
    ((2, 4, 16, 8), (2, 3, 16, 8), "kv_heads=3 must divide heads=4"),
    ((2, 4, 16, 8), (2, 2, 16, 4), "batch, seq and dim must match"),
    ((4, 16, 8), (2, 2, 16, 8), "q [batch, heads, seq, dim]"),
])
def test_bad_shapes_are_refused_in_one_line(q_shape, kv_shape, rule):
    with pytest.raises(ValueError) as caught:
        ring_attention(torch.zeros(q_shape), torch.zeros(kv_shape), torch.zeros(kv_shape), None)
    assert rule in str(caught.value) and "\n" not in str(caught.value)
