"""model=hf: a local transformers decoder as pipeline layers gives the model's own loss, each stage
reads only its own tensors, and what cannot be trained is refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from models import build_model, check_tensor_parallel_config   # noqa: E402
from models.errors import ConfigError   # noqa: E402
from models.facts import parameter_count, pipeline_layer_count   # noqa: E402
from models.families.hf import SafetensorsCheckpoint, hf_model   # noqa: E402
from pipedream.config.loading import compose_config   # noqa: E402
from tests.support.hf_models import save_tiny   # noqa: E402

KINDS = ["llama", "gpt2", "mistral", "qwen2"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {kind: save_tiny(kind, root / kind, max_shard_size="20KB" if kind != "gpt2" else None) for kind in KINDS}


def model_cfg(folder: Path, *extra: str):
    return compose_config(["model=hf", f"model.path={folder}", *extra]).model


@pytest.mark.parametrize("kind", KINDS)
def test_layers_give_the_models_own_loss(folders, kind):
    import transformers
    folder = folders[kind]
    model = build_model(model_cfg(folder, "model.seq_len=12"))
    ours = model.build_sequential().eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    inputs, targets = model.make_batch(3, torch.Generator().manual_seed(1))
    assert inputs.shape == (3, 12)
    with torch.no_grad():
        loss = model.loss_fn(ours(inputs), targets)
        expected = model.loss_fn(theirs(inputs).logits, targets)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-5)


def test_config_keys_come_from_config_json(folders):
    cfg = model_cfg(folders["gpt2"])
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.seq_len, cfg.vocab_size, cfg.tie_embeddings) == \
        (3, 32, 4, 32, 64, True)
    assert model_cfg(folders["llama"], "model.seq_len=8").seq_len == 8
    assert pipeline_layer_count(cfg) == 5
    import transformers
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(folders["gpt2"]), local_files_only=True)
    assert parameter_count(cfg) == sum(p.numel() for p in reference.parameters())   # the tied head once


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_each_stage_reads_only_its_own_tensors(folders, kind):
    folder = folders[kind]
    stored = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"] \
        if (folder / "model.safetensors.index.json").exists() else None
    prefix = {"llama": ("model.embed_tokens.", "model.layers.", "model.norm.", "lm_head."),
              "gpt2": ("transformer.wte.", "transformer.h.", "transformer.ln_f.", "lm_head.")}[kind]
    embed, layers, norm, head = prefix
    stages = {"first": [0, 1], "middle": [2], "last": [3, 4]}
    expected_prefixes = {"first": (embed, "transformer.wpe.", f"{layers}0."), "middle": (f"{layers}1.",),
                         "last": (f"{layers}2.", norm, head if kind == "llama" else embed)}
    for stage, indices in stages.items():
        reader = SafetensorsCheckpoint(folder)
        with torch.device("meta"):   # shape inference: nothing is read
            hf_model(model_cfg(folder), checkpoint=reader).build()
        assert reader.keys_read == []
        hf_model(model_cfg(folder), checkpoint=reader).build(indices)
        read = set(reader.keys_read)
        assert read and all(key.startswith(expected_prefixes[stage]) for key in read), (stage, sorted(read))
        if kind == "gpt2":   # the tied head reads the embedding's table (lm_head.weight is not stored)
            assert ("transformer.wte.weight" in read) == (stage != "middle")
        if stored is not None:
            files = {stored[key] for key in read}
            assert len(files) < len(set(stored.values()))   # only some of the shards were opened


def test_bad_folders_and_architectures_are_refused_in_one_line(tmp_path, folders):
    with pytest.raises(ConfigError, match=r"model.path='/no/such' does not exist") as missing:
        model_cfg(Path("/no/such"))
    assert "\n" not in str(missing.value)
    with pytest.raises(ConfigError, match="model=hf needs model.path=DIR"):
        compose_config(["model=hf"])
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ConfigError, match=r"describes BertForMaskedLM.*supported are LlamaForCausalLM.*GPT2LMHeadModel"):
        model_cfg(bert)
    with pytest.raises(ConfigError, match="model=hf has no tensor-parallel form but parallel.tp=2"):
        check_tensor_parallel_config(model_cfg(folders["llama"]), 2)


def test_a_longer_window_than_the_context_is_refused(folders):
    from pipedream.config.run_spec import build_run_spec
    cfg = compose_config(["model=hf", f"model.path={folders['llama']}", "model.seq_len=64", "data=synthetic",
                          "parallel.pp=1"])
    with pytest.raises(ConfigError, match=r"model.seq_len=64 must be a positive integer at most the model's context \(32"):
        build_run_spec(cfg, 1)


def test_without_transformers_one_line_says_how_to_install(folders, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "transformers", None)   # import transformers now raises ImportError
    with pytest.raises(ConfigError, match=r"model=hf needs the Hugging Face packages \(transformers is missing\): "
                                          r"pip install \.\[hf\]"):
        build_model(model_cfg(folders["llama"]))


def test_export_dispatches_through_the_family():
    from pipedream.export import ExportError, hf_converter, shard_tensors
    from models.families.gpt_hf import gpt_to_hf
    from models.families.hf import to_hf
    assert hf_converter({"name": "hf"}) is to_hf and hf_converter({"name": "gpt"}) is gpt_to_hf
    with pytest.raises(ExportError, match="model=mlp has no Hugging Face form: .*use format=torch"):
        hf_converter({"name": "mlp"})
    with pytest.raises(ExportError, match=r"model=my.Model \(a plugin\) has no Hugging Face form"):
        hf_converter({"_target_": "my.Model"})
    state = {name: torch.zeros(250) for name in "abcde"}   # 1000 bytes each
    assert [list(shard) for shard in shard_tensors(state, 2000)] == [["a", "b"], ["c", "d"], ["e"]]
    assert [list(shard) for shard in shard_tensors(state, 10)] == [[name] for name in "abcde"]


def test_gpt_exports_as_gpt2_with_the_same_logits():
    import transformers
    from models.families.gpt_hf import gpt_to_hf
    for tie in (True, False):
        cfg = {"name": "gpt", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_len": 16, "vocab_size": 64,
               "tie_embeddings": tie, "dropout": 0.0}
        ours = build_model(cfg, seed=3).build_sequential().eval()
        config, state = gpt_to_hf({k: v.detach() for k, v in ours.state_dict().items()}, cfg)
        config = transformers.GPT2Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
        theirs = transformers.GPT2LMHeadModel(config).eval()
        theirs.load_state_dict(state, strict=not tie)   # tied: lm_head is the token table
        tokens = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=0, atol=1e-5)


def test_sizes_that_contradict_config_json_are_refused(folders):
    from pipedream.config.run_spec import build_run_spec
    cfg = compose_config(["model=hf", f"model.path={folders['llama']}", "model.num_layers=5", "data=synthetic",
                          "parallel.pp=1"])
    with pytest.raises(ConfigError, match=r"model.num_layers=5 differs from the model's config.json \(3\)"):
        build_run_spec(cfg, 1)
