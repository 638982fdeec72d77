"""model=hf with mixture-of-experts decoders (Mixtral, also with a sliding window, Qwen2-MoE, also
with renormalised top-k weights and MoE in every second layer): the layers' logits, loss with the load-balancing
term, and gradients are transformers' own (output_router_logits=True); a stage reads only its
layers' tensors and an expert-parallel rank only its experts'; the export gives back the stored
tensors; a token counts the FLOPs of its top-k experts; under bf16 the slot counts cross the
layers as integers; what cannot be reproduced is refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from models import build_model, check_expert_parallel_config   # noqa: E402
from models.context_parallel import ContextParallel   # noqa: E402
from models.errors import ConfigError   # noqa: E402
from models.expert_parallel import ExpertParallel   # noqa: E402
from models.families.hf import SafetensorsCheckpoint, hf_model, to_hf   # noqa: E402
from pipedream.config.loading import compose_config   # noqa: E402
from tests.support.hf_models import MOE_CONFIGS   # noqa: E402

VARIANTS = {"mixtral": ("mixtral", {}), "qwen2_moe": ("qwen2_moe", {}),
            "mixtral_sliding_window": ("mixtral", {"sliding_window": 4}),   # shorter than the 12 tokens
            "qwen2_moe_renormalised_every2": ("qwen2_moe", {"norm_topk_prob": True, "decoder_sparse_step": 2,
                                                            "mlp_only_layers": []})}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_moe")
    saved = {}
    for name, (kind, changes) in VARIANTS.items():
        config = MOE_CONFIGS[kind](transformers)
        for key, value in changes.items():
            setattr(config, key, value)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():   # routers far from uniform: a wrong expert or weight would show
            for param_name, param in model.named_parameters():
                if param_name.endswith("mlp.gate.weight"):
                    param.normal_(0.0, 0.5)
        model.save_pretrained(str(root / name), max_shard_size="30KB")
        saved[name] = root / name
    return saved


def model_cfg(folder: Path, *extra: str):
    return compose_config(["model=hf", f"model.path={folder}", "model.seq_len=12", *extra]).model


@pytest.mark.parametrize("name", VARIANTS)
def test_logits_loss_and_gradients_are_transformers_own(folders, name):
    folder = folders[name]
    model = build_model(model_cfg(folder))
    ours = model.build_sequential().train()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).train()
    coef = theirs.config.router_aux_loss_coef
    inputs, targets = model.make_batch(3, torch.Generator().manual_seed(1))
    model.statistics.collected = []   # the head hands over the load-balancing term
    logits = ours(inputs)
    loss = model.loss_fn(logits, targets) + sum(model.statistics.collected)
    targets = targets.contiguous()   # make_batch slices a window: transformers views the labels flat
    output = theirs(inputs, labels=targets, shift_labels=targets, output_router_logits=True)
    torch.testing.assert_close(logits, output.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, output.loss, rtol=0, atol=1e-6)
    assert float(coef * output.aux_loss.detach()) > 1e-3   # the term is there to be matched
    loss.backward()
    output.loss.backward()
    first_moe = next(i for i in range(1, len(ours) - 1) if hasattr(ours[i].layer.mlp, "router"))
    router = theirs.model.layers[first_moe - 1].mlp.gate.weight.grad
    torch.testing.assert_close(ours[first_moe].layer.mlp.router.weight.grad, router, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours[0].embed.weight.grad, theirs.model.embed_tokens.weight.grad, rtol=0, atol=1e-6)


def test_the_load_balancing_term_is_over_all_layers_at_once(folders):
    """transformers' loss is not the mean of per-layer losses (what model=llama trains with)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(folders["mixtral"]), local_files_only=True)
    tokens = torch.randint(64, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        router_logits = theirs(tokens, output_router_logits=True).router_logits
    whole = load_balancing_loss_func(router_logits, 4, 2)
    per_layer = torch.stack([load_balancing_loss_func((layer,), 4, 2) for layer in router_logits]).mean()
    assert abs(float(whole - per_layer)) > 1e-4


def test_a_stage_reads_its_layers_and_an_expert_parallel_rank_its_experts(folders):
    folder = folders["qwen2_moe"]   # layers 0 and 2 MoE, 1 dense
    stored = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    reader = SafetensorsCheckpoint(folder)
    layers = hf_model(model_cfg(folder), checkpoint=reader, ep=ExpertParallel(group=object(), rank=1, size=2))
    built = layers.build([1, 2])
    read = set(reader.keys_read)
    experts = {name.split(".")[5] for name in read if ".experts." in name}
    assert experts == {"2", "3"}
    assert all(name.startswith(("model.layers.0.", "model.layers.1.")) for name in read)
    unread = {name for name in stored if name.startswith("model.layers.0.") and ".experts." not in name} - read
    assert unread == set()   # attention, norms, router, shared expert and its gate: all of layer 0's own
    assert sorted(built[1].layer.mlp.experts.keys()) == ["2", "3"]
    assert all(getattr(p, "expert_parallel", False) for p in built[1].layer.mlp.experts.parameters())


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_the_export_gives_back_the_stored_tensors(folders, name):
    from safetensors.torch import load_file
    folder = folders[name]
    network = build_model(model_cfg(folder)).build_sequential()
    config, state = to_hf({key: value.detach() for key, value in network.state_dict().items()}, model_cfg(folder))
    stored = {}
    for file in folder.glob("*.safetensors"):
        stored.update(load_file(str(file)))
    assert config["architectures"] == json.loads((folder / "config.json").read_text())["architectures"]
    assert sorted(state) == sorted(stored)
    for key, tensor in stored.items():
        assert torch.equal(state[key], tensor), key


def test_what_cannot_be_reproduced_is_refused_in_one_line(folders, tmp_path):
    from pipedream.config.run_spec import build_run_spec
    for key, value, match in (("router_jitter_noise", 0.1, r"router_jitter_noise=0.1: model=hf routes without jitter"),
                              ("hidden_act", "gelu", r"hidden_act='gelu': model=hf's MoE experts are SwiGLU")):
        changed = tmp_path / key
        changed.mkdir()
        config = json.loads((folders["mixtral"] / "config.json").read_text()) | {key: value}
        (changed / "config.json").write_text(json.dumps(config))
        for file in folders["mixtral"].glob("model*"):
            (changed / file.name).symlink_to(file)
        cfg = compose_config(["model=hf", f"model.path={changed}", "data=synthetic", "parallel.pp=1"])
        with pytest.raises(ConfigError, match=match) as error:
            build_run_spec(cfg, 1)   # before any process group
        assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=r"parallel.ep=3 does not divide .*num_experts=4"):
        check_expert_parallel_config(model_cfg(folders["mixtral"]), 3)
    check_expert_parallel_config(model_cfg(folders["mixtral"]), 2)
    with pytest.raises(ConfigError, match=r"parallel.cp=2 with a mixture-of-experts model"):
        hf_model(model_cfg(folders["mixtral"]), cp=ContextParallel(group=object(), rank=0, size=2))


def test_a_token_counts_the_flops_of_its_top_k_experts(folders):
    from models.families.hf_facts import hf_flops_per_iteration
    # per layer: q, o 32 x 32, k, v 16 x 32, the router 4 x 32, and top-2 of 4 SwiGLU experts 3 x 24 x 32
    layer = 2 * 32 * 32 + 2 * 16 * 32 + 4 * 32 + 2 * 3 * 24 * 32
    forward = 2 * 16 * (3 * layer + 64 * 32) + 4 * 3 * 16 * 16 * 32   # + the head; attention's s x s products
    assert hf_flops_per_iteration({"path": str(folders["mixtral"]), "seq_len": 16}, 1, False) == 3 * forward


def test_under_bf16_the_slot_counts_cross_the_layers_exact(folders):
    from pipedream.numerics.precision import MixedPrecision
    model = build_model(model_cfg(folders["mixtral"]))
    network = model.build_sequential().train()
    precision = MixedPrecision("bf16", "cpu")
    precision.apply(list(network))   # every floating-point output leaves in bf16, as on a stage boundary
    arrived = []
    network[-1].register_forward_pre_hook(lambda module, inputs: arrived.append(inputs))
    inputs, _ = model.make_batch(32, torch.Generator().manual_seed(3))   # 32 x 12 tokens: > 256 slots per expert
    with precision.autocast():
        network(inputs)
    hidden, counts, shares = arrived[0]
    assert hidden.dtype == shares.dtype == torch.bfloat16 and counts.dtype == torch.int64
    assert int(counts.sum()) == 3 * 32 * 12 * 2 and int(counts.max()) > 256   # 3 MoE layers, top-2
    assert float(shares.detach().float().sum()) == pytest.approx(1.0, abs=1e-2)   # the mean router probabilities
