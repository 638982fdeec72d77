"""GPT, Llama and ``model=hf`` decoders built with context parallelism (``build_model(..., cp=...)``)
train exactly as in one process: each cp rank runs every layer on its zigzag shard of the tokens
and targets, and the average of the local mean losses and the cp-averaged parameter gradients
equal the loss and the gradients of the whole sequence in one process, in float32.

One set of four processes computes every case, at cp=4 (the world) and cp=2 (two pairs, so group
ranks differ from global ones), and gpt / llama at tp=2 x cp=2 with and without sequence
parallelism (tp groups {0,1},{2,3}, cp groups {0,2},{1,3}: tp fastest), their tensor-parallel
gradients gathered over the tp group; each rank returns its averaged results beside its own
single-process reference. The refusals are checked in the test process, without workers."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from models import build_model
from models.attention import selectively_recompute
from models.context_parallel import ContextParallel, split_zigzag
from models.errors import ConfigError
from models.tensor_parallel import TensorParallel, gather_tensor, shard_spec
from tests.support.workers import run_workers

WORLD = 4
BATCH = 3
TINY_GPT = dict(name="gpt", num_layers=2, hidden_size=32, num_heads=4, seq_len=16, vocab_size=67, dropout=0.0)
TINY_LLAMA = dict(name="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=40,
                  seq_len=16, vocab_size=67, tie_embeddings=False)   # grouped-query: 2 kv heads for 4
MODELS = {"gpt_tied": {**TINY_GPT, "tie_embeddings": True}, "gpt_untied": {**TINY_GPT, "tie_embeddings": False},
          "llama_gqa": TINY_LLAMA}


def loss_and_grads(cfg: dict, cp: ContextParallel | None, tokens: torch.Tensor, targets: torch.Tensor,
                   recompute: bool = False, tp: TensorParallel | None = None
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's loss on ``tokens`` (forward + backward) and its parameter gradients, a
    tensor-parallel shard's gathered over ``tp``; ``recompute``: with selective recomputation, which
    replays the ring in the backward."""
    model = build_model(cfg, seed=3, tp=tp, cp=cp)
    layers = model.build_sequential()
    if recompute:
        assert selectively_recompute(layers) == len(layers) - 2   # one attention core per block
    loss = model.loss_fn(layers(tokens), targets)
    loss.backward()
    return loss.detach(), {name: param.grad if shard_spec(param) is None else
                           gather_tensor(param.grad, shard_spec(param), tp)
                           for name, param in layers.named_parameters()}


def group_mean(tensor: torch.Tensor, group) -> torch.Tensor:
    total = tensor.clone()
    dist.all_reduce(total, group=group)
    return total / dist.get_world_size(group)


def averaged(loss: torch.Tensor, grads: dict[str, torch.Tensor], group) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    # equal token counts per rank, so the mean over all tokens is the mean of the local means
    return group_mean(loss, group), {name: group_mean(grad, group) for name, grad in grads.items()}


def _case(cfg: dict, group, tp: TensorParallel | None = None) -> dict:
    """Every rank of ``group`` (cp) runs its zigzag shard; with ``tp`` each of the tp ranks too."""
    cp = ContextParallel.from_group(group)
    tokens, targets = build_model(cfg, seed=3).make_batch(BATCH, torch.Generator().manual_seed(4))
    shards = [split_zigzag(t, cp.size, cp.rank, 1) for t in (tokens, targets)]
    return {"cp": cp.size, "expected": loss_and_grads(cfg, None, tokens, targets),
            "got": averaged(*loss_and_grads(cfg, cp, *shards, tp=tp), group),
            "recomputed": averaged(*loss_and_grads(cfg, cp, *shards, recompute=True, tp=tp), group)}


def _worker(rank: int, world_size: int, hf_folders: dict[str, str]) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        # every rank creates every group, in one order; the pairs are cp groups, and tp groups below
        pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
        across = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
        models = {**MODELS, **{f"hf_{kind}": hf_config(folder) for kind, folder in hf_folders.items()}}
        results = {f"{name}_cp{dist.get_world_size(group)}": _case(cfg, group)
                   for name, cfg in models.items() for group in (pair, dist.group.WORLD)}
        for name, cfg in MODELS.items():
            for sequence_parallel in (False, True):
                tp = TensorParallel.from_group(pair, sequence_parallel)
                results[f"{name}_tp2cp2_sp{int(sequence_parallel)}"] = _case(cfg, across, tp)
        return results
    finally:
        dist.destroy_process_group()


def hf_config(folder: str) -> dict:
    return {"name": "hf", "path": folder, "seq_len": 16}


def saved_hf_models(folder: Path) -> dict[str, str]:
    """Tiny random LlamaForCausalLM (4 heads, 2 kv heads) and GPT2LMHeadModel (learned positions)
    as save_pretrained writes them; none without transformers."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {}
    from tests.support.hf_models import save_tiny
    return {"llama": str(save_tiny("llama", folder / "llama")),
            "gpt2": str(save_tiny("gpt2", folder / "gpt2", max_shard_size=None))}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_workers(_worker, WORLD, saved_hf_models(tmp_path_factory.mktemp("hf")), timeout=180)


CASES = ([f"{name}_cp{cp}" for name in [*MODELS, "hf_llama", "hf_gpt2"] for cp in (2, 4)] +
         [f"{name}_tp2cp2_sp{sp}" for name in MODELS for sp in (0, 1)])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("run", ["got", "recomputed"])
def test_loss_and_gradients_equal_the_whole_sequence_in_one_process(results, case, run):
    if case not in results[0]:
        pytest.skip("model=hf needs transformers")
    for rank, result in enumerate(results):
        (loss, grads), (expected_loss, expected_grads) = result[case][run], result[case]["expected"]
        torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-5, msg=lambda m: f"rank {rank} loss: {m}")
        assert grads.keys() == expected_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {case} grad {name}: {m}")


# single-process checks: a stand-in group is enough, as these build nothing that communicates

class StandInGroup:
    """Where a process group would go; building a layer never uses it."""


def two_ranks() -> ContextParallel:
    return ContextParallel(group=StandInGroup(), rank=0, size=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_cp_of_one_builds_the_plain_model(name):
    cfg = MODELS[name]
    plain, single = build_model(cfg, seed=3).build_sequential(), build_model(cfg, seed=3, cp=ContextParallel())
    single = single.build_sequential()
    assert repr(single) == repr(plain)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), single.state_dict().values()))
    assert list(single.state_dict()) == list(plain.state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("cfg, cp, rule", [
    ({**TINY_GPT, "dropout": 0.1}, two_ranks(), "ring attention has no dropout"),
    ({**TINY_GPT, "seq_len": 18}, two_ranks(), "not divisible by 2·cp = 4"),
    ({**TINY_GPT, "name": "bert"}, two_ranks(), "model=bert has no context-parallel form"),
    ({"_target_": "somewhere:model"}, two_ranks(), "(a plugin) has no context-parallel form"),
])
def test_what_cannot_be_built_is_refused_in_one_line(cfg, cp, rule):
    with pytest.raises(ConfigError) as caught:
        build_model(cfg, seed=0, cp=cp)
    assert rule in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.slow
def test_a_shard_sequence_parallelism_cannot_cut_is_refused_in_one_line():
    tp = TensorParallel(group=StandInGroup(), rank=0, size=4, sequence_parallel=True)
    with pytest.raises(ConfigError) as caught:   # 20 tokens over cp=2 leave 10 per rank, not 4 parts
        build_model({**TINY_GPT, "seq_len": 20}, seed=0, tp=tp, cp=two_ranks())
    assert "cannot cut into tp=4 equal parts" in str(caught.value) and "\n" not in str(caught.value)
    assert "multiple of 8" in str(caught.value)
    build_model({**TINY_GPT, "seq_len": 20}, seed=0, tp=TensorParallel(group=StandInGroup(), rank=0, size=4),
                cp=two_ranks())   # without sequence parallelism each tp rank holds the whole shard


@pytest.mark.slow
@pytest.mark.parametrize("kind, rule", [("mistral", "decoder layer 0 attends through a sliding window"),
                                        ("gpt2_dropout", "attention dropout 0.1 (config.json)")])
def test_hf_attention_the_ring_cannot_compute_is_refused_in_one_line(tmp_path, kind, rule):
    pytest.importorskip("transformers")
    import json
    from tests.support.hf_models import save_tiny
    folder = save_tiny(kind.split("_")[0], tmp_path / kind)
    if kind == "gpt2_dropout":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "attn_pdrop": 0.1}))
    with pytest.raises(ConfigError) as caught:
        build_model({"name": "hf", "path": str(folder), "seq_len": 16}, seed=0, cp=two_ranks())
    assert rule in str(caught.value) and "\n" not in str(caught.value)
