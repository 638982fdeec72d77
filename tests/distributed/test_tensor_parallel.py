"""Tensor-parallel layers, loss and whole models on two gloo ranks equal their dense forms.

One pair of processes computes every case (spawning is the slow part); each rank compares its
tensor-parallel result, gathered over the group, with the dense module it sliced, and returns the
pairs; the tests below assert on rank 0's pairs and on what must agree or differ across ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from models import build_model, check_tensor_parallel_config, gpt_model
from models.families.gpt import MLP, CausalSelfAttention
from pipedream.errors import ConfigError
from models.grad_accumulation import fuse_grad_accumulation
from models.tensor_parallel import (ColumnParallelLinear, ParallelMLP, ParallelSelfAttention, RNGTracker,
                                       RowParallelLinear, TensorParallel, VocabParallelEmbedding, gather_chunks,
                                       gather_from_region, gather_tensor, grad_norm_squared, scatter_chunk, shard_spec,
                                       shard_tensor, vocab_parallel_cross_entropy)
from models.tensor_parallel.mappings import gather_last, split_last
from tests.support.workers import run_workers

Pairs = dict[str, tuple[torch.Tensor, torch.Tensor]]
TINY = dict(num_layers=2, hidden_size=32, num_heads=4, seq_len=16, vocab_size=251)  # 251: padded to 252


def _compare_module(name: str, dense: nn.Module, parallel: nn.Module, x: torch.Tensor, tp: TensorParallel,
                    out: Pairs, output_sharded: bool = False, input_sharded: bool = False) -> None:
    """Output, input gradient and every (gathered) parameter gradient of ``parallel`` vs ``dense``."""
    dense.zero_grad(set_to_none=True)
    floating = x.is_floating_point()
    x_dense = x.clone().requires_grad_(floating)
    y = dense(x_dense)
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    y.backward(grad_y)
    x_par = (split_last(x, tp) if input_sharded else x).clone().requires_grad_(floating)
    y_par = parallel(x_par)
    y_par.backward(split_last(grad_y, tp) if output_sharded else grad_y)
    out[f"{name}.out"] = (gather_last(y_par.detach(), tp) if output_sharded else y_par.detach(), y.detach())
    if floating:
        out[f"{name}.grad_input"] = (gather_last(x_par.grad, tp) if input_sharded else x_par.grad, x_dense.grad)
    dense_params = dict(dense.named_parameters())
    for pname, param in parallel.named_parameters():
        spec = shard_spec(param)
        grad = param.grad.clone() if spec is None else gather_tensor(param.grad, spec, tp)
        out[f"{name}.grad.{pname}"] = (grad, dense_params[pname].grad)


def _layer_cases(tp: TensorParallel) -> Pairs:
    out: Pairs = {}
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 16, generator=gen)
    torch.manual_seed(2)
    dense = nn.Linear(16, 24)
    _compare_module("column", dense, ColumnParallelLinear.from_dense(dense, tp), x, tp, out, output_sharded=True)
    _compare_module("column_fused", dense, ColumnParallelLinear.from_dense(dense, tp, stride=3, gather_output=True),
                    x, tp, out)
    dense = nn.Linear(16, 8)
    _compare_module("row", dense, RowParallelLinear.from_dense(dense, tp), x, tp, out, input_sharded=True)
    _compare_module("row_scatter", dense, RowParallelLinear.from_dense(dense, tp, input_is_parallel=False), x, tp, out)
    embedding = nn.Embedding(11, 6)  # 11 ids: padded to 12 over two ranks
    tokens = torch.randint(11, (4, 7), generator=gen)
    _compare_module("embedding", embedding, VocabParallelEmbedding.from_dense_weight(embedding.weight.detach(), tp),
                    tokens, tp, out)
    h = torch.randn(2, 6, 32, generator=gen)
    for causal in (True, False):
        attn = CausalSelfAttention(32, 4, 0.0, 0.02, causal=causal)
        parallel = ParallelSelfAttention.from_dense(attn, tp, RNGTracker(0, tp.rank))
        _compare_module(f"attention_causal{causal}", attn, parallel, h, tp, out)
    mlp = MLP(32, 0.0, 0.02)
    _compare_module("mlp", mlp, ParallelMLP.from_dense(mlp, tp), h, tp, out)
    # weight gradients accumulated inside the GEMM (train.fuse_grad_accumulation), twice over
    parallel = ParallelMLP.from_dense(mlp, tp)
    assert fuse_grad_accumulation(parallel) == 2
    _compare_module("mlp_accumulated", mlp, parallel, h, tp, out)
    _compare_module("mlp_accumulated", mlp, parallel, h, tp, {})
    for pname, param in parallel.named_parameters():   # the second backward added to the first
        spec = shard_spec(param)
        grad = param.grad if spec is None else gather_tensor(param.grad, spec, tp)
        out[f"mlp_accumulated.twice.{pname}"] = (grad, 2 * dict(mlp.named_parameters())[pname].grad)
    return out


def _cross_entropy_cases(tp: TensorParallel) -> Pairs:
    gen = torch.Generator().manual_seed(3)
    vocab = 11
    logits = (3 * torch.randn(2, 9, vocab, generator=gen)).requires_grad_(True)
    targets = torch.randint(vocab, (2, 9), generator=gen)
    targets[0, :4] = -100
    dense = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=-100)
    dense.backward()
    padded = F.pad(logits.detach(), (0, 1))  # 12 columns, the last one padding
    shard = split_last(padded, tp).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(shard, targets, tp, vocab)
    loss.backward()
    grad = gather_last(shard.grad, tp)
    return {"ce.loss": (loss.detach(), dense.detach()), "ce.grad": (grad[..., :vocab], logits.grad),
            "ce.grad_padding": (grad[..., vocab:], torch.zeros_like(grad[..., vocab:]))}


def _whole_model_cases(tp: TensorParallel, name: str, extra: dict) -> Pairs:
    cfg = {"name": name, **TINY, **extra}
    dense_model, tp_model = build_model(cfg, seed=5), build_model(cfg, seed=5, tp=tp)
    inputs, targets = dense_model.make_batch(4, torch.Generator().manual_seed(6))
    dense, parallel = dense_model.build_sequential(), tp_model.build_sequential()
    dense_loss = dense_model.loss_fn(dense(inputs), targets)
    dense_loss.backward()
    loss = tp_model.loss_fn(parallel(inputs), targets)
    loss.backward()
    out = {f"{name}.loss": (loss.detach(), dense_loss.detach()),
           f"{name}.grad_norm_sq": (grad_norm_squared(parallel.parameters(), tp).float(),
                                    sum(p.grad.pow(2).sum() for p in dense.parameters()))}
    dense_params = dict(dense.named_parameters())
    for pname, param in parallel.named_parameters():
        spec = shard_spec(param)
        out[f"{name}.weight.{pname}"] = (param.detach() if spec is None else gather_tensor(param.detach(), spec, tp),
                                         dense_params[pname].detach())
        out[f"{name}.grad.{pname}"] = (param.grad if spec is None else gather_tensor(param.grad, spec, tp),
                                       dense_params[pname].grad)
    logits = parallel(inputs)
    out[f"{name}.gathered_logits"] = (gather_from_region(logits, tp)[..., :TINY["vocab_size"]], dense(inputs))
    return out


def _dropout_cases(tp: TensorParallel) -> dict[str, torch.Tensor]:
    """Replicated outputs agree across ranks, sharded masks differ, recomputation replays both."""
    torch.manual_seed(11)  # the trainer seeds every rank alike
    model = gpt_model(1, 32, 4, 16, dropout=0.3, seed=5, tp=tp)
    layers = model.build_sequential().train()
    inputs, targets = model.make_batch(2, torch.Generator().manual_seed(6))
    found: dict[str, torch.Tensor] = {}
    with RNGTracker(0, tp.rank).fork():
        found["forked_draw"] = torch.rand(4)
    found["global_draw_after_fork"] = torch.rand(4)

    def run(recompute: bool) -> list[torch.Tensor]:
        layers.zero_grad()
        torch.manual_seed(12)
        hidden = layers[0](inputs)
        block_out = checkpoint(layers[1], hidden, use_reentrant=False) if recompute else layers[1](hidden)
        loss = model.loss_fn(layers[2](block_out), targets)
        loss.backward()
        return [block_out.detach(), loss.detach()] + [p.grad.clone() for p in layers.parameters()]

    plain, recomputed = run(False), run(True)
    found["block_out"] = plain[0]
    found["recompute_max_diff"] = torch.stack([(a - b).abs().max() for a, b in zip(plain, recomputed)]).max()
    return found


def _misc_cases(tp: TensorParallel) -> dict[str, object]:
    full = torch.arange(24.0).reshape(2, 3, 4)
    chunk = scatter_chunk(full, tp)
    meta_model = gpt_model(2, 32, 4, 16, tp=tp)
    with torch.device("meta"):
        layers = meta_model.build_sequential()
        meta_out = layers(torch.empty(2, 16, dtype=torch.long))
    fused = torch.arange(12.0).reshape(12, 1)  # [q; k; v] of 4 rows each
    column = ColumnParallelLinear(8, 6, tp)
    x = torch.randn(3, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = column(x)
    low.float().sum().backward()
    return {"chunk_numel": chunk.numel(), "roundtrip": torch.equal(gather_chunks(chunk, tp, full.shape), full),
            "meta_logits_shape": tuple(meta_out.shape),
            "autocast_dtypes": (low.dtype, x.grad.dtype, column.weight.grad.dtype),
            "fused_shard": shard_tensor(fused, shard_spec(ColumnParallelLinear(1, 12, tp, stride=3).weight), tp)}


def _worker(rank: int, world_size: int) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        tp = TensorParallel.from_group(dist.group.WORLD)
        pairs: Pairs = {}
        pairs.update(_layer_cases(tp))
        pairs.update(_cross_entropy_cases(tp))
        pairs.update(_whole_model_cases(tp, "gpt", {}))
        pairs.update(_whole_model_cases(tp, "bert", {}))
        pairs.update(_whole_model_cases(tp, "bert_preln", {"name": "bert", "pre_ln": True}))
        return {"pairs": pairs, "dropout": _dropout_cases(tp), "misc": _misc_cases(tp)}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, 2, timeout=120)


def _assert_pairs(results: list[dict], prefix: str) -> None:
    pairs = {k: v for k, v in results[0]["pairs"].items() if k.startswith(prefix)}
    assert pairs, prefix
    for key, (got, expected) in pairs.items():
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("prefix", ["column.", "column_fused.", "row.", "row_scatter.", "embedding.",
                                    "attention_causalTrue.", "attention_causalFalse.", "mlp.", "mlp_accumulated."])
def test_layers_equal_their_dense_slices(results, prefix):
    _assert_pairs(results, prefix)


def test_vocab_parallel_cross_entropy_equals_dense_loss_and_gradient(results):
    _assert_pairs(results, "ce.")


@pytest.mark.parametrize("name", ["gpt.", "bert.", "bert_preln."])
def test_whole_tp2_model_equals_dense(results, name):
    _assert_pairs(results, name)


def test_both_ranks_agree_on_replicated_results(results):
    for key in ("gpt.loss", "bert.loss", "gpt.grad.1.ln1.weight", "gpt.grad_norm_sq"):
        assert torch.equal(results[0]["pairs"][key][0], results[1]["pairs"][key][0]), key


def test_dropout_rng_agrees_where_replicated_differs_where_sharded_and_replays(results):
    first, second = results[0]["dropout"], results[1]["dropout"]
    assert not torch.equal(first["forked_draw"], second["forked_draw"])     # sharded region: own stream
    assert torch.equal(first["global_draw_after_fork"], second["global_draw_after_fork"])  # global in step
    assert torch.equal(first["block_out"], second["block_out"])            # replicated output identical
    assert first["recompute_max_diff"] == 0 and second["recompute_max_diff"] == 0


def test_scatter_gather_meta_shapes_autocast_and_fused_shards(results):
    for rank, found in enumerate(results):
        misc = found["misc"]
        assert misc["chunk_numel"] == 12 and misc["roundtrip"]
        assert misc["meta_logits_shape"] == (2, 16, 128)  # this rank's half of 256 ids
        assert misc["autocast_dtypes"] == (torch.bfloat16, torch.float32, torch.float32)
        expected = [0, 1, 4, 5, 8, 9] if rank == 0 else [2, 3, 6, 7, 10, 11]  # whole q, k, v rows per rank
        assert misc["fused_shard"].flatten().tolist() == expected


def test_bad_divisibility_is_one_config_error_line():
    with pytest.raises(ConfigError, match=r"^model.num_heads=6 is not divisible by parallel.tp=4: ") as error:
        check_tensor_parallel_config({"name": "gpt", "hidden_size": 48, "num_heads": 6}, 4)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="model=mlp has no tensor-parallel form"):
        check_tensor_parallel_config({"name": "mlp", "hidden_size": 8}, 2)
    check_tensor_parallel_config({"name": "bert", "hidden_size": 48, "num_heads": 6}, 3)


def test_size_one_layers_equal_dense_without_a_process_group():
    cfg = {"name": "gpt", **TINY}
    dense_model, tp_model = build_model(cfg, seed=1), build_model(cfg, seed=1, tp=TensorParallel.single())
    inputs, targets = dense_model.make_batch(2, torch.Generator().manual_seed(0))
    dense, parallel = dense_model.build_sequential(), tp_model.build_sequential()
    torch.testing.assert_close(tp_model.loss_fn(parallel(inputs), targets),
                               dense_model.loss_fn(dense(inputs), targets), rtol=1e-5, atol=1e-6)
    sharded = {name for name, p in parallel.named_parameters() if p.tensor_parallel_sharded}
    assert "1.attn.qkv.weight" in sharded and "1.ln1.weight" not in sharded and "0.wpe.weight" not in sharded
