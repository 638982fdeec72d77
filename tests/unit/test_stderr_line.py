"""Ranks share the launcher's stderr: a line written in two system calls (what `print` does) runs
into another rank's line ("...malformederror: ..."). Each report must reach the stream in one write."""
from __future__ import annotations

import io
import sys

from pipedream.errors import stderr_line


class Writes(io.TextIOBase):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)


def test_a_line_and_its_newline_go_out_in_one_write(monkeypatch):
    stream = Writes()
    monkeypatch.setattr(sys, "stderr", stream)
    stderr_line("error: injected fault on rank 1: the batch is malformed")
    assert stream.calls == ["error: injected fault on rank 1: the batch is malformed\n"]


def test_a_rank_failure_after_start_is_one_write(monkeypatch):
    from pipedream.errors import DataError
    from pipedream.train import run
    from tests.support.training_harness import compose_config

    def failing_train(spec, ctx):
        raise DataError("injected fault on rank 0: the batch is malformed")
    monkeypatch.setattr("pipedream.trainer.train", failing_train)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    stream = Writes()
    monkeypatch.setattr(sys, "stderr", stream)
    run(compose_config(["model=mlp", "data=synthetic", "model.num_layers=2", "model.hidden_size=8",
                        "parallel.pp=1", "train.global_batch_size=8", "train.micro_batch_size=2",
                        "train.steps=2"]))
    assert stream.calls == ["error: injected fault on rank 0: the batch is malformed\n"]
