"""``python -m pipedream.export format=hf``: the data's tokenizer (as its meta.json names it) copied
beside the weights with its BOS/EOS ids in config.json and generation_config.json, so transformers
loads and generates from the folder as written; one line where the data has no tokenizer; every file
with the umask's permissions; an unknown key named with the closest known one."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

import pipedream.export as export
from models import build_model
from pipedream.data.prepare import prepare
from tests.unit.data.test_prepare import byte_level_bpe, write_documents

LLAMA = {"name": "llama", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 64, "seq_len": 16, "vocab_size": 320, "tie_embeddings": False, "norm_eps": 1e-5,
         "rope_theta": 10000.0, "rope_scaling": None}
EOS = "<|endoftext|>"


@pytest.fixture
def umask_027():
    """A known umask: new files are rw-r----- (0o640)."""
    previous = os.umask(0o027)
    yield 0o640
    os.umask(previous)


def fake_run(folder: Path, data_cfg: dict, monkeypatch) -> Path:
    """A run whose newest checkpoint records ``data_cfg``; the consolidated state is a fresh LLAMA's
    (the checkpoint format itself is tests/distributed/test_hf_models.py's)."""
    checkpoint = folder / "run" / "checkpoints" / "step_00000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "extra.json").write_text(json.dumps({"config": {"model": LLAMA, "data": data_cfg}}))
    state = {name: p.detach() for name, p in build_model(LLAMA, seed=0).build_sequential().state_dict().items()}
    monkeypatch.setattr(export, "choose_checkpoint", lambda root, step: checkpoint)
    monkeypatch.setattr(export, "consolidate", lambda path: state)
    return folder / "run"


def token_data(folder: Path, tokenizer_config: dict | None = None, eos: str | None = EOS) -> Path:
    """``python -m pipedream.data.prepare``'s output for the test documents and a small byte-level BPE."""
    byte_level_bpe(folder / "tok", eos=eos)
    if tokenizer_config is not None:
        (folder / "tok" / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    write_documents(folder / "text")
    prepare(str(folder / "tok"), str(folder / "text"), folder / "data")
    return folder / "data"


def test_the_export_carries_the_data_tokenizer_and_generates(tmp_path, monkeypatch, capsys, umask_027):
    transformers = pytest.importorskip("transformers")
    run = fake_run(tmp_path, {"name": "token_bin", "path": str(token_data(tmp_path))}, monkeypatch)
    out = tmp_path / "hf"
    assert export.main([f"run_dir={run}", "format=hf", f"out={out}"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"wrote {out}: config.json, generation_config.json, model.safetensors.index.json, tokenizer.json, "
        f"tokenizer_config.json, 1 safetensors shard(s)"]
    eos_id = json.loads((tmp_path / "data" / "meta.json").read_text())["eos_id"]
    ids = {"bos_token_id": eos_id, "eos_token_id": eos_id}   # the data's documents start after an EOS
    assert json.loads((out / "generation_config.json").read_text()) == ids
    assert ids.items() <= json.loads((out / "config.json").read_text()).items()
    assert json.loads((out / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS, "eos_token": EOS}
    assert {path.name: stat.S_IMODE(path.stat().st_mode) for path in out.iterdir()} == {
        path.name: umask_027 for path in out.iterdir()}   # the safetensors shard too, not 0o600
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, model.generation_config.eos_token_id) == (eos_id,) * 3
    prompt = tokenizer("Each stage owns", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] <= prompt.input_ids.shape[1] + 3
    assert tokenizer.decode(generated[0]).startswith("Each stage owns")


@pytest.mark.parametrize("bos_in_vocabulary", [True, False])
def test_a_saved_tokenizers_own_config_is_kept_with_the_data_eos(bos_in_vocabulary, tmp_path):
    from tokenizers import Tokenizer

    data = token_data(tmp_path, {"bos_token": {"content": "[BOS]"}, "eos_token": "[END]", "chat_template": "{{x}}"},
                      eos="[END]")
    source = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    if bos_in_vocabulary:
        source.add_special_tokens(["[BOS]"])
        source.save(str(tmp_path / "tok" / "tokenizer.json"))
    tokenizer = export.run_tokenizer({"name": "token_bin", "path": str(data)})
    end = json.loads((data / "meta.json").read_text())["eos_id"]
    # a BOS the vocabulary lacks: generation starts from the EOS, as every document of the data does
    bos, bos_id = ("[BOS]", source.token_to_id("[BOS]")) if bos_in_vocabulary else ("[END]", end)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.file) == (bos_id, end, tmp_path / "tok" / "tokenizer.json")
    assert tokenizer.config == {"bos_token": bos, "eos_token": "[END]", "chat_template": "{{x}}",
                                "tokenizer_class": "PreTrainedTokenizerFast"}


def test_a_tokenizer_without_eos_exports_null_ids(tmp_path):
    tokenizer = export.run_tokenizer({"name": "token_bin", "path": str(token_data(tmp_path, eos=None))})
    assert (tokenizer.bos_id, tokenizer.eos_id) == (None, None)
    assert export.special_token_ids(tokenizer, {"bos_token_id": 1}) == {"bos_token_id": None, "eos_token_id": None}


def test_without_a_tokenizer_the_converters_ids_stay_and_none_become_null():
    assert export.special_token_ids(None, {"bos_token_id": 1, "eos_token_id": 2}) == {"bos_token_id": 1,
                                                                                      "eos_token_id": 2}
    assert export.special_token_ids(None, {"model_type": "llama"}) == {"bos_token_id": None, "eos_token_id": None}


def test_byte_level_data_exports_the_weights_and_says_so_in_one_line(tmp_path, monkeypatch, capsys, umask_027):
    run = fake_run(tmp_path, {"name": "pydoc", "val_fraction": 0.1}, monkeypatch)
    out = tmp_path / "hf"
    assert export.main([f"run_dir={run}", "format=hf", f"out={out}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == [f"note: no tokenizer in {out}: the run's data (data=pydoc) has none: pydoc and text_file "
                         f"are byte-level (ids are UTF-8 bytes); data=token_bin from python -m "
                         f"pipedream.data.prepare records its tokenizer"]
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "generation_config.json",
                                                           "model-00001-of-00001.safetensors",
                                                           "model.safetensors.index.json"]
    config = json.loads((out / "config.json").read_text())   # null: not LlamaConfig's defaults 1 and 2
    assert (config["bos_token_id"], config["eos_token_id"]) == (None, None)


@pytest.mark.parametrize("case", ["missing-path", "no-meta", "tiktoken", "gone"])
def test_token_data_without_a_usable_tokenizer_is_named(case, tmp_path):
    data = token_data(tmp_path)
    meta = json.loads((data / "meta.json").read_text())
    expect = {"missing-path": f"data.path={tmp_path / 'elsewhere'} does not exist here: export from the folder",
              "no-meta": f"{data / 'meta.json'} does not exist: python -m pipedream.data.prepare writes one",
              "tiktoken": "names tokenizer tiktoken:gpt2, not a tokenizer.json",
              "gone": f"{tmp_path / 'tok' / 'tokenizer.json'}, the tokenizer {data / 'meta.json'} names, does not load"}
    path = tmp_path / "elsewhere" if case == "missing-path" else data
    if case == "no-meta":
        (data / "meta.json").unlink()
    elif case == "tiktoken":
        (data / "meta.json").write_text(json.dumps({**meta, "tokenizer": "tiktoken:gpt2"}))
    elif case == "gone":
        (tmp_path / "tok" / "tokenizer.json").unlink()
    with pytest.raises(export.NoTokenizer) as reason:
        export.run_tokenizer({"name": "token_bin", "path": str(path)})
    assert expect[case] in str(reason.value) and "\n" not in str(reason.value)


def test_torch_format_files_get_the_umask_permissions(tmp_path, umask_027):
    written = export._save({"w": torch.zeros(3)}, tmp_path / "model.pt")
    assert [path.suffix for path in written] == [".pt", ".safetensors"]
    assert {stat.S_IMODE(path.stat().st_mode) for path in written} == {umask_027}


@pytest.mark.parametrize("argv, expect", [
    (["run_dir=r", "formt=hf"], "error: unknown key 'formt' (python -m pipedream.export takes run_dir, out, step, "
                                "format, shard_mb): did you mean 'format'?"),
    (["run_dir=r", "zzz=1"], "error: unknown key 'zzz' (python -m pipedream.export takes run_dir, out, step, format, "
                             "shard_mb): check its spelling"),
])
def test_an_unknown_key_is_named_with_the_closest_known_one(argv, expect, capsys):
    assert export.main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [expect]


def test_usage_without_run_dir(capsys):
    assert export.main(["format=hf"]) == 2
    assert capsys.readouterr().err.startswith("usage: python -m pipedream.export")
