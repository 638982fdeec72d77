"""Hugging Face models in and out: a tiny Llama and GPT-2 (model=hf) and the gpt and llama families
trained on a two-stage pipeline (the Llama also at cp = 2) equal single-process training, and their checkpoints exported with
format=hf load in transformers (LlamaForCausalLM, GPT2LMHeadModel) with the same logits."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from models import build_model   # noqa: E402
from pipedream.config.loading import compose_config   # noqa: E402
from pipedream.export import main as export_main   # noqa: E402
from tests.support.hf_models import HF_RUN, save_tiny   # noqa: E402
from tests.support.training_harness import (TINY_GPT, assert_matches_reference, merge_params,   # noqa: E402
                                            reference_training, train_rank)
from tests.support.workers import run_workers   # noqa: E402

PIPELINE = ["parallel.pp=2", "parallel.dp=1", "train.steps=2", "checkpoint.every=2", "optim=sgd"]


def exported_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    with torch.no_grad():
        return model(tokens).logits


def sequential_logits(overrides: list[str], params: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    network = build_model(compose_config(overrides).model).build_sequential().eval()
    loaded = network.load_state_dict(params, strict=False)
    # every key is set, none left over: a tied head is among the reference's names (both names of
    # the one Parameter), and the rotary tables are non-persistent buffers, not in the state dict
    assert (loaded.missing_keys, loaded.unexpected_keys) == ([], []), loaded
    with torch.no_grad():
        return network(tokens)


@pytest.mark.slow
def test_hf_models_train_on_a_pipeline_and_export_back(tmp_path):
    llama, gpt2 = save_tiny("llama", tmp_path / "llama"), save_tiny("gpt2", tmp_path / "gpt2", max_shard_size=None)
    runs = {"llama": ["model=hf", f"model.path={llama}", "train.lr=0.05", *HF_RUN, *PIPELINE],
            "gpt2": ["model=hf", f"model.path={gpt2}", "train.lr=0.05", *HF_RUN, *PIPELINE],
            "llama-lr0": ["model=hf", f"model.path={llama}", "train.lr=1e-12", *HF_RUN, *PIPELINE],
            # context parallelism: each rank half of every sequence, the ring in the HF attention
            "llama-cp2": ["model=hf", f"model.path={llama}", "train.lr=0.05", *HF_RUN, *PIPELINE, "parallel.pp=1",
                          "parallel.cp=2"],
            "gpt": [*TINY_GPT, "model.num_layers=2", "model.tie_embeddings=false", "train.lr=0.05", *PIPELINE],
            "llama-family": ["model=llama_tiny", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
                             "model.num_kv_heads=2", "model.ffn_hidden_size=64", "model.seq_len=16",
                             "model.tie_embeddings=true", *[o for o in TINY_GPT if o.startswith("train.")],
                             "train.lr=0.05", *PIPELINE]}
    per_rank = run_workers(train_rank, 2, [(config, str(tmp_path / name)) for name, config in runs.items()])
    tokens = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    for index, (name, config) in enumerate(runs.items()):
        params = merge_params([rank_results[index] for rank_results in per_rank])
        reference = reference_training(config)
        assert_matches_reference({"params": params, "losses": per_rank[0][index]["losses"]}, reference)
        out = tmp_path / f"{name}-hf"
        assert export_main([f"run_dir={tmp_path / name}", "format=hf", f"out={out}", "shard_mb=0.01"]) == 0
        assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").exists()
        expected = (exported_logits(llama, tokens) if name == "llama-lr0"   # lr ~ 0 (it must be > 0): the original
                    else sequential_logits(config, reference["params"], tokens))
        torch.testing.assert_close(exported_logits(out, tokens), expected, rtol=0, atol=1e-5)
