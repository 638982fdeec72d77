"""``python -m pipedream.data.prepare``: text through a local tokenizer into the token_bin layout and
its meta.json, read back by ``data=token_bin``; its refusals are one line and exit code 2."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

import pipedream.data.prepare as prepare
from pipedream.data.corpora import token_dtype_for
from pipedream.data.datasets import load_token_corpus

tokenizers = pytest.importorskip("tokenizers")

DOCUMENTS = {"a.txt": "Pipelines split a model\ninto stages.\r\nEach stage owns its layers.\n",
             "sub/b.txt": "Micro-batches flow — naïve schedules idle;\n\n1F1B keeps every stage busy.",
             "c.txt": "Weights stash per version.\n" * 40}


def byte_level_bpe(folder, eos: str | None = "<|endoftext|>"):
    """A small byte-level BPE (decodes back to the exact text) trained on the documents, saved as
    folder/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[eos] if eos else [],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(DOCUMENTS.values(), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return tokenizer


def write_documents(folder):
    for name, text in DOCUMENTS.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(text.encode("utf-8"))
    return [DOCUMENTS[name] for name in sorted(DOCUMENTS, key=lambda n: str(folder / n))]


def all_tokens(out):
    train, val = load_token_corpus({"name": "token_bin", "path": str(out), "val_fraction": 0.1}, 1 << 20, 0)
    return np.concatenate([np.asarray(train), np.asarray(val)]).astype(np.int64)


def test_tokens_decode_back_to_every_document(tmp_path, monkeypatch, capsys):
    tokenizer = byte_level_bpe(tmp_path / "tok")
    texts = write_documents(tmp_path / "text")
    monkeypatch.setattr(prepare, "CHUNK_BYTES", 64)      # many chunks, cut at line ends
    monkeypatch.setattr(prepare, "REPORT_BYTES", 256)
    code = prepare.main([f"tokenizer={tmp_path / 'tok'}", f"input={tmp_path / 'text'}", f"out={tmp_path / 'out'}",
                         "val_fraction=0.2"])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith(f"wrote {tmp_path / 'out' / 'train.bin'}")
    lines = err.splitlines()   # not a terminal: a line per REPORT_BYTES, no bar frames
    assert 1 <= len(lines) <= sum(len(t.encode()) for t in texts) // 256 and all(l.startswith("prepare: ") for l in lines)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == tokenizer.get_vocab_size() and meta["eos_id"] == eos
    assert meta["tokenizer"] == str((tmp_path / "tok" / "tokenizer.json").resolve()) and meta["files"] == 3
    tokens = all_tokens(tmp_path / "out")
    assert meta["tokens"]["train"] + meta["tokens"]["val"] == len(tokens)
    assert meta["tokens"]["val"] == len(tokens) - int(len(tokens) * 0.8)
    ends = np.flatnonzero(tokens == eos)
    assert len(ends) == 3 and ends[-1] == len(tokens) - 1   # EOS after every document
    documents = np.split(tokens, ends + 1)[:-1]
    assert [tokenizer.decode(d[:-1].tolist()) for d in documents] == texts


def test_without_an_eos_documents_are_separated_as_text_files_are(tmp_path):
    tokenizer = byte_level_bpe(tmp_path / "tok", eos=None)
    texts = write_documents(tmp_path / "text")
    meta = prepare.prepare(str(tmp_path / "tok" / "tokenizer.json"), str(tmp_path / "text"), tmp_path / "out")
    assert meta["eos_id"] is None and meta["document_end"] == "\n\n"
    assert tokenizer.decode(all_tokens(tmp_path / "out").tolist()) == "\n\n".join(texts)


def test_the_eos_named_by_tokenizer_config_json_ends_each_document(tmp_path):
    tokenizer = byte_level_bpe(tmp_path / "tok", eos="[END]")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "[END]"}}))
    write_documents(tmp_path / "text")
    meta = prepare.prepare(str(tmp_path / "tok"), str(tmp_path / "text"), tmp_path / "out")
    assert meta["eos_id"] == tokenizer.token_to_id("[END]") and meta["document_end"] == "eos"
    assert int((all_tokens(tmp_path / "out") == meta["eos_id"]).sum()) == len(DOCUMENTS)


def test_a_vocabulary_over_65536_is_written_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 70_000)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "text.txt").write_text((" ".join(f"w{i}" for i in range(69_990, 70_000)) + " w3 nope\n") * 20)
    meta = prepare.prepare(str(tmp_path / "tokenizer.json"), str(tmp_path / "text.txt"), tmp_path / "out", 0.5)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_000
    assert (tmp_path / "out" / "train.bin").stat().st_size == 4 * meta["tokens"]["train"]
    assert all_tokens(tmp_path / "out")[:13].tolist() == [*range(69_990, 70_000), 3, 0, 69_990]
    assert (token_dtype_for(65_536), token_dtype_for(65_537)) == ("uint16", "uint32")


@pytest.mark.parametrize("case", ["no-tokenizer", "no-tokenizer-json", "no-input", "empty-input", "empty-folder",
                                  "no-package", "bad-fraction", "too-short"])
def test_refusals_are_one_line(case, tmp_path, monkeypatch, capsys):
    byte_level_bpe(tmp_path / "tok")
    (tmp_path / "text.txt").write_text("Stages pass activations forward.\n" * 4)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "emptydir").mkdir()
    args = {"tokenizer": tmp_path / "tok", "input": tmp_path / "text.txt", "out": tmp_path / "out"}
    expect = {"no-tokenizer": "does not exist: give a tokenizer.json", "no-tokenizer-json": "holds no tokenizer.json",
              "no-input": "does not exist: give a text file", "empty-input": "holds no text (0 bytes)",
              "empty-folder": "is an empty folder", "no-package": "needs the tokenizers package: pip install .[hf]",
              "bad-fraction": "val_fraction=1.5 must be in (0, 1)", "too-short": "too few to split"}[case]
    extra = []
    if case == "no-tokenizer":
        args["tokenizer"] = tmp_path / "missing" / "tokenizer.json"
    elif case == "no-tokenizer-json":
        args["tokenizer"] = tmp_path / "emptydir"
    elif case in ("no-input", "empty-input", "empty-folder"):
        args["input"] = tmp_path / {"no-input": "missing.txt", "empty-input": "empty.txt", "empty-folder": "emptydir"}[case]
    elif case == "no-package":
        monkeypatch.setitem(sys.modules, "tokenizers", None)   # import tokenizers now raises ImportError
    elif case == "bad-fraction":
        extra = ["val_fraction=1.5"]
    else:
        extra = ["val_fraction=1e-20"]   # rounds to an empty validation split
    code = prepare.main([f"{key}={value}" for key, value in args.items()] + extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and expect in err[0], err
    assert not (tmp_path / "out" / "train.bin").exists() and not (tmp_path / "out" / "tokens.partial").exists()


@pytest.mark.parametrize("argv, hint", [(["tokenzier=x", "input=y", "out=z"], "did you mean 'tokenizer'?"),
                                        (["tokenizer=x", "input=y", "outt=z"], "did you mean 'out'?"),
                                        (["tokenizer=x", "input=y", "out=z", "colour=red"], "check its spelling")])
def test_an_unknown_key_is_named_with_the_closest_known_one(argv, hint, capsys):
    assert prepare.main(argv) == 2
    key = next(a.split("=")[0] for a in argv if a.split("=")[0] not in prepare.KEYS)
    assert capsys.readouterr().err.splitlines() == [
        f"error: unknown key {key!r} (python -m pipedream.data.prepare takes tokenizer, input, out, val_fraction): "
        f"{hint}"]


def test_usage_without_a_required_key(capsys):
    assert prepare.main(["tokenizer=x", "input=y"]) == 2
    assert capsys.readouterr().err.startswith("usage: python -m pipedream.data.prepare")
