"""Hugging Face mixture-of-experts decoders in and out: a tiny random MixtralForCausalLM and a
Qwen2MoeForCausalLM (a dense layer among MoE ones, a gated shared expert, top-2 weights not
renormalised) train through model=hf at pp=2 x dp=2 with ep=2 (each rank two of the four experts
of each MoE layer) as single-process training does; the first step's loss plus the load-balancing
term equals transformers' own loss (output_router_logits=True, router_aux_loss_coef) on the same
micro-batches; the trained run exported with format=hf loads in transformers with the logits of
the trained model's own forward. model=mixtral_tiny trained alike exports as a MixtralForCausalLM
with its logits. One launch of 4 ranks trains the three."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from pipedream.config.loading import compose_config   # noqa: E402
from pipedream.export import main as export_main   # noqa: E402
from tests.distributed.test_hf_models import exported_logits, sequential_logits   # noqa: E402
from tests.support.hf_models import HF_RUN, MOE_CONFIGS, save_tiny   # noqa: E402
from tests.support.training_harness import (assert_matches_reference, merge_params, reference_training,   # noqa: E402
                                            train_rank)
from tests.support.workers import run_workers   # noqa: E402

LAYOUT = ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "schedule=1f1b", "train.steps=2", "checkpoint.every=2",
          "optim=sgd", "train.lr=0.05"]
MIXTRAL_TINY = ["model=mixtral_tiny", *HF_RUN, *LAYOUT]


def transformers_first_step_loss(folder: Path, overrides: list[str]) -> float:
    """transformers' own loss (cross-entropy + router_aux_loss_coef x its load-balancing loss), as the
    run averages it: over the first step's micro-batches, each a forward of its own."""
    import transformers
    from pipedream.data.batching import GlobalBatchOrder, microbatches
    from pipedream.data.datasets import build_datasets

    cfg = compose_config(overrides)
    train_set, _ = build_datasets(cfg.model, cfg.data, int(cfg.train.seed))
    order = GlobalBatchOrder(len(train_set), int(cfg.train.global_batch_size), int(cfg.train.seed))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    losses = []
    with torch.no_grad():
        for inputs, targets in microbatches(train_set, order.indices(0), int(cfg.train.micro_batch_size)):
            # shift_labels: the targets are already the next tokens
            output = model(inputs, labels=targets, shift_labels=targets, output_router_logits=True)
            losses.append(float(output.loss))
    return sum(losses) / len(losses)


@pytest.mark.slow
def test_hf_moe_models_train_with_expert_parallelism_and_export_back(tmp_path):
    folders = {kind: save_tiny(kind, tmp_path / kind) for kind in MOE_CONFIGS}
    runs = {kind: ["model=hf", f"model.path={folder}", *HF_RUN, *LAYOUT] for kind, folder in folders.items()}
    launches = [(config, str(tmp_path / f"{kind}-run")) for kind, config in runs.items()]
    per_rank = run_workers(train_rank, 4, launches + [(MIXTRAL_TINY, str(tmp_path / "mixtral_tiny-run"))])
    tokens = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))

    # model=llama's MoE preset exports as a Mixtral with the trained model's logits
    out = tmp_path / "mixtral_tiny-hf"
    assert export_main([f"run_dir={tmp_path / 'mixtral_tiny-run'}", "format=hf", f"out={out}"]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    params = merge_params([rank_results[-1] for rank_results in per_rank])
    torch.testing.assert_close(exported_logits(out, tokens), sequential_logits(MIXTRAL_TINY, params, tokens),
                               rtol=0, atol=1e-5)

    for index, (kind, config) in enumerate(runs.items()):
        params = merge_params([rank_results[index] for rank_results in per_rank])
        reference = reference_training(config)
        assert_matches_reference({"params": params, "losses": per_rank[0][index]["losses"]}, reference)
        held = [{name.split(".")[4] for name in rank_results[index]["params"] if ".experts." in name}
                for rank_results in per_rank]
        assert held == [{"0", "1"}, {"2", "3"}] * 2   # ep groups (0, 1) and (2, 3)

        first = per_rank[0][index]["records"][0]
        coef = json.loads((folders[kind] / "config.json").read_text())["router_aux_loss_coef"]
        ours = first["loss"] + coef * first["moe_aux_loss"]
        assert first["moe_aux_loss"] > 0
        moe_layers = {"mixtral": 3, "qwen2_moe": 2}[kind]   # Qwen2-MoE's layer 1 is dense
        assert sum(first["moe_tokens_per_expert"]) == moe_layers * 8 * 16 * 2   # x global batch x sequence x top-2
        assert ours == pytest.approx(transformers_first_step_loss(folders[kind], config), abs=1e-5)

        out = tmp_path / f"{kind}-hf"
        assert export_main([f"run_dir={tmp_path / f'{kind}-run'}", "format=hf", f"out={out}"]) == 0
        torch.testing.assert_close(exported_logits(out, tokens), sequential_logits(config, params, tokens),
                                   rtol=0, atol=1e-5)
