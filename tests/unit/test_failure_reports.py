"""Each class of error that ends a run becomes its own line on stderr and a non-zero exit code
(``pipedream.train.run`` with a trainer that raises)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipedream.checkpoint.store import CheckpointError
from pipedream.errors import FINAL_EXIT, ConfigError, DataError, InvariantError
from pipedream.numerics.optim import NonFiniteError
from pipedream.train import run
from tests.support.training_harness import compose_config

MLP = ["model=mlp", "data=synthetic", "model.num_layers=2", "model.hidden_size=8", "parallel.pp=1",
       "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=2", "train.timeout_s=7"]


def _run_raising(monkeypatch, capsys, error: BaseException, overrides: list[str] = ()) -> tuple[int, str]:
    def failing_train(spec, ctx):
        raise error
    monkeypatch.setattr("pipedream.trainer.train", failing_train)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    code = run(compose_config(MLP + list(overrides)))
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("error, line", [
    (DataError("schedule=2bw needs one shape"), "error: schedule=2bw needs one shape"),
    (ConfigError("data.path is not set"), "error: data.path is not set"),
    (NonFiniteError("training loss is nan: stopped"), "error: training loss is nan: stopped"),
    (CheckpointError("train.resume=x is not a usable checkpoint"), "error: train.resume=x is not a usable checkpoint"),
    (dist.DistBackendError("NCCL error: remote process exited"),
     "error: rank 0: communication failed (a peer died, or was silent longer than train.timeout_s=7): "
     "NCCL error: remote process exited"),
    (RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:705"),
     "error: rank 0: communication failed (a peer died, or was silent longer than train.timeout_s=7): "
     "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:705"),
    # Gloo's messages for a silent peer, verbatim from torch 2.13 (the first wait, then any later one)
    (RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to "
                  "complete"),
     "error: rank 0: communication failed (a peer died, or was silent longer than train.timeout_s=7): "
     "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete"),
    (RuntimeError("Application timeout caused pair closure"),
     "error: rank 0: communication failed (a peer died, or was silent longer than train.timeout_s=7): "
     "Application timeout caused pair closure"),
    (dist.DistNetworkError("failed to connect to the store"),
     "error: rank 0: communication failed (a peer died, or was silent longer than train.timeout_s=7): "
     "failed to connect to the store"),
    (RuntimeError("shape mismatch\nmore detail"), "error: rank 0: RuntimeError: shape mismatch"),
    (KeyError("weight"), "error: rank 0: KeyError: 'weight'"),
])
def test_each_error_is_one_line(monkeypatch, capsys, error, line) -> None:
    code, err = _run_raising(monkeypatch, capsys, error)
    deterministic = isinstance(error, (DataError, ConfigError, NonFiniteError, CheckpointError))
    assert code == (FINAL_EXIT if deterministic else 1) and err == line


def test_a_nan_is_reported_by_rank_0_only(monkeypatch, capsys) -> None:
    """Every rank sees a non-finite loss or norm (they are all-reduced): one line, not one per rank."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr("pipedream.train.first_attempt_rank0", lambda: False)
    def failing_train(spec, ctx):
        raise NonFiniteError("training loss is nan: stopped")
    monkeypatch.setattr("pipedream.trainer.train", failing_train)
    assert run(compose_config(MLP)) == FINAL_EXIT
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"),
                                   MemoryError()])
def test_out_of_memory_says_so(monkeypatch, capsys, error) -> None:
    code, err = _run_raising(monkeypatch, capsys, error)
    assert code == 1 and err.startswith("error: rank 0: out of memory (") and "train.micro_batch_size" in err
    assert "communication failed" not in err and "\n" not in err


def test_invariant_violations_are_reported_as_internal(monkeypatch, capsys) -> None:
    code, err = _run_raising(monkeypatch, capsys, InvariantError("weight version 3 was freed"))
    assert code == 1
    assert err.startswith("error: rank 0: internal error (InvariantError): weight version 3 was freed")
    assert "communication failed" not in err


@pytest.mark.parametrize("switch", ["env", "config"])
def test_debug_adds_the_traceback(monkeypatch, capsys, switch) -> None:
    overrides = ["train.debug=true"] if switch == "config" else []
    if switch == "env":
        monkeypatch.setenv("PIPEDREAM_DEBUG", "1")
    code, err = _run_raising(monkeypatch, capsys, ValueError("bad value"), overrides)
    assert code == 1 and err.startswith("Traceback") and err.endswith("error: rank 0: ValueError: bad value")


def test_a_refused_config_exits_2_before_training(monkeypatch, capsys) -> None:
    code, err = _run_raising(monkeypatch, capsys, AssertionError("not reached"), ["train.lr=0"])
    assert code == 2 and err.startswith("error: train.lr = 0 must be > 0")
