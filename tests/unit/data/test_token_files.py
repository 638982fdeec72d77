"""token_bin files with and without meta.json (dtype, vocabulary) as the datasets and the pre-launch
data check read them; vocabularies the model cannot embed are refused in one line."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pipedream.data.checks import check_data
from pipedream.data.corpora import read_token_meta
from pipedream.data.datasets import load_token_corpus
from pipedream.errors import ConfigError

GPT = {"name": "gpt", "vocab_size": 70_000}
BERT = {"name": "bert", "vocab_size": 70_000}


def token_folder(folder, ids, meta: dict | None, dtype=np.uint32):
    folder.mkdir()
    np.asarray(ids, dtype=dtype).tofile(folder / "train.bin")
    np.asarray(ids[:40], dtype=dtype).tofile(folder / "val.bin")
    if meta is not None:
        (folder / "meta.json").write_text(json.dumps(meta))
    return {"name": "token_bin", "path": str(folder), "val_fraction": 0.1}


def test_meta_json_gives_the_dtype_and_without_it_files_are_uint16(tmp_path):
    ids = list(range(69_900, 70_000))
    data = token_folder(tmp_path / "wide", ids, {"dtype": "uint32", "vocab_size": 70_000})
    train, val = load_token_corpus(data, 70_000, 0)
    assert train.dtype == np.uint32 and train.tolist() == ids and len(val) == 40
    assert check_data(data, GPT, 16) == []
    plain = token_folder(tmp_path / "plain", list(range(100)), None, np.uint16)
    assert read_token_meta(tmp_path / "plain").dtype == "uint16"
    assert load_token_corpus(plain, 256, 0)[0].tolist() == list(range(100))
    (tmp_path / "one").mkdir()   # one .bin file: the meta.json beside it
    np.arange(65_600, 65_700, dtype=np.uint32).tofile(tmp_path / "one" / "all.bin")
    (tmp_path / "one" / "meta.json").write_text(json.dumps({"dtype": "uint32"}))
    one = {"name": "token_bin", "path": str(tmp_path / "one" / "all.bin"), "val_fraction": 0.5}
    assert load_token_corpus(one, 70_000, 0)[1].tolist() == list(range(65_650, 65_700))


def test_a_recorded_vocabulary_larger_than_the_models_is_refused(tmp_path):
    data = token_folder(tmp_path / "wide", list(range(100)), {"dtype": "uint32", "vocab_size": 70_000})
    with pytest.raises(ConfigError, match=r"records a tokenizer vocabulary of 70000 tokens, more than "
                                          r"model.vocab_size=50000: set model.vocab_size=70000"):
        check_data(data, {"name": "gpt", "vocab_size": 50_000}, 16)
    with pytest.raises(ConfigError, match=r"keeps one more id for \[MASK\]\): set model.vocab_size=70001"):
        check_data(data, BERT, 16)


@pytest.mark.parametrize("meta, expect", [({"dtype": "int8"}, "records dtype='int8'"),
                                          ({"dtype": "uint32", "vocab_size": -3}, "records vocab_size=-3"),
                                          ("{not json", "is not readable JSON")])
def test_a_bad_meta_json_is_one_line(tmp_path, meta, expect):
    folder = tmp_path / "bad"
    token_folder(folder, list(range(100)), None)
    (folder / "meta.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    with pytest.raises(ConfigError, match=expect):
        read_token_meta(folder)


def test_a_uint32_file_of_the_wrong_size_is_refused(tmp_path):
    data = token_folder(tmp_path / "wide", list(range(100)), {"dtype": "uint32"})
    with (tmp_path / "wide" / "train.bin").open("ab") as stream:
        stream.write(b"\x00\x00")
    with pytest.raises(ConfigError, match=r"holds 402 bytes, not a multiple of 4: token_bin files are uint32 arrays"):
        check_data(data, GPT, 16)


def test_byte_corpora_need_a_vocabulary_for_their_bytes(tmp_path):
    (tmp_path / "text.txt").write_text("plain ascii text, " * 40)
    text = {"name": "text_file", "path": str(tmp_path / "text.txt"), "val_fraction": 0.1}
    assert check_data(text, {"name": "gpt", "vocab_size": 128}, 16) == []   # ASCII fits 128 ids
    with pytest.raises(ConfigError, match=r"holds token id 120 >= model.vocab_size=100: raise model.vocab_size to "
                                          r"at least 256"):
        check_data(text, {"name": "gpt", "vocab_size": 100}, 16)
    with pytest.raises(ConfigError, match=r"holds token id 120 >= 120, the \[MASK\] id of model=bert"):
        check_data(text, {"name": "bert", "vocab_size": 121}, 16)
    (tmp_path / "text.txt").write_bytes(b"latin-1 caf\xe9 " * 40)   # read as U+FFFD: bytes up to 0xEF
    with pytest.raises(ConfigError, match=r"holds token id 239 >= model.vocab_size=200"):
        check_data(text, {"name": "gpt", "vocab_size": 200}, 16)
    pydoc = {"name": "pydoc", "val_fraction": 0.1}
    assert check_data(pydoc, {"name": "gpt", "vocab_size": 256}, 16) == []
    with pytest.raises(ConfigError, match=r"data=pydoc \(byte-level tokens, 0..255\) holds token id"):
        check_data(pydoc, {"name": "gpt", "vocab_size": 128}, 16)
