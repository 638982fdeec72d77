"""Throughput formulas, the logged step line and the progress-bar decision, the peak-FLOP/s cache behind
MFU, memory peaks and optional TensorBoard."""
from __future__ import annotations

import importlib.util
import io
import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from models import build_model
from models.families.formulas import gpt_flops_per_iteration, mlp_flops_per_iteration
from pipedream.errors import ConfigError
from pipedream.observe.metrics import (RunWriter, StepTimes, Throughput, check_tensorboard, format_mfu,
                                       format_step_line, model_flops_per_iteration, peak_memory_bytes,
                                       progress_bar_wanted, warmup_steps)
from pipedream.observe.peak_flops import device_key, measure_matmul_flops, peak_flops


def test_mlp_flops_is_six_times_parameters_times_samples() -> None:
    layers, hidden, batch = 3, 64, 10
    model = build_model({"name": "mlp", "num_layers": layers, "hidden_size": hidden})
    weights = sum(p.numel() for p in model.build_sequential().parameters() if p.dim() == 2)
    assert mlp_flops_per_iteration(batch, layers, hidden) == 6 * weights * batch
    assert mlp_flops_per_iteration(batch, layers, hidden, recompute=True) == 8 * weights * batch


def test_model_flops_follow_the_recompute_flag() -> None:
    gpt = OmegaConf.create({"name": "gpt", "num_layers": 2, "hidden_size": 64, "num_heads": 2, "seq_len": 32,
                            "vocab_size": 256})
    for recompute in (False, True):
        assert model_flops_per_iteration(gpt, 8, 16, recompute) == gpt_flops_per_iteration(8, 2, 64, 256, 16,
                                                                                           recompute=recompute)
    assert model_flops_per_iteration(gpt, 8, None, True) == gpt_flops_per_iteration(8, 2, 64, 256, 32, True)
    mlp = OmegaConf.create({"name": "mlp", "num_layers": 2, "hidden_size": 8})
    assert model_flops_per_iteration(mlp, 4, None, False) == 3 * 4 * 4 * 2 * 8 * 8


def test_throughput_is_consistent() -> None:
    t = Throughput(global_batch=32, tokens_per_sample=128, flops_per_iteration=4e12, devices=4,
                   peak_flops_per_device=2e12)
    m = t.of(0.5)
    assert m["samples_per_s"] * 0.5 == 32 and m["tokens_per_s"] == 32 * 128 / 0.5
    assert m["tflops_per_device"] == pytest.approx(2.0) and m["mfu"] == pytest.approx(1.0)
    assert Throughput(1, 1, 1.0, 1, 0.0).of(1.0)["mfu"] is None   # no known peak: no MFU


def test_throughput_leaves_unknown_quantities_null() -> None:
    no_tokens = Throughput(global_batch=8, tokens_per_sample=None, flops_per_iteration=8e12, devices=1,
                           peak_flops_per_device=1e12).of(2.0)
    assert no_tokens["samples_per_s"] == 4.0 and no_tokens["tokens_per_s"] is None
    assert no_tokens["mfu"] == pytest.approx(4.0)
    no_flops = Throughput(8, 16, 0.0, 1, 1e12).of(2.0)
    assert no_flops["tokens_per_s"] == 64.0
    assert no_flops["tflops_per_device"] is None and no_flops["mfu"] is None
    assert json.loads(json.dumps(no_flops))["mfu"] is None   # null in metrics.jsonl and summary.json


def record(**metrics) -> dict:
    return {"step": 7, "loss": 1.25, "lr": 1e-3, "step_time_s": 0.02, "samples_per_s": 2828.0, **metrics}


def test_step_line_shows_tokens_only_for_sequences() -> None:
    sequence = format_step_line(record(tokens_per_s=45248.0, mfu=0.123), 10)
    assert sequence == ("step     7/10  loss 1.2500  lr 1.00e-03  step 20 ms  2828.0 samples/s  45248 tokens/s  "
                        "MFU 12.3%")
    classifier = format_step_line(record(tokens_per_s=None, mfu=0.05, val_loss=0.5), 10)
    assert "tokens/s" not in classifier and classifier.endswith("2828.0 samples/s  MFU 5.0%  val_loss 0.5000")


def test_step_line_never_shows_an_unknown_mfu_as_zero() -> None:
    for unknown in (None, float("nan")):
        assert format_step_line(record(tokens_per_s=None, mfu=unknown), 10).endswith("samples/s  MFU n/a")
    assert format_mfu(3.1e-5) == "0.0031%" and format_mfu(0.0004) == "0.04%"   # tiny but known: its digits
    assert format_mfu(0.5) == "50.0%" and format_mfu(None) == "n/a"


class Stream(io.StringIO):
    def __init__(self, terminal: bool):
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


def test_progress_bar_only_on_a_terminal_on_rank_0_when_enabled() -> None:
    assert progress_bar_wanted(True, 0, Stream(terminal=True))
    assert not progress_bar_wanted(True, 0, Stream(terminal=False))   # a pipe or a log file
    assert not progress_bar_wanted(True, 1, Stream(terminal=True))
    assert not progress_bar_wanted(False, 0, Stream(terminal=True))
    closed = io.StringIO()
    closed.close()
    assert not progress_bar_wanted(True, 0, closed)   # isatty raises ValueError
    assert not progress_bar_wanted(True, 0, None)


def test_step_times_skip_warmup() -> None:
    times = StepTimes()
    for value in [9.0] * 5 + [1.0] * 20:
        times.add(value)
    assert times.warmup() == warmup_steps(25) == 5 and times.median_after_warmup() == 1.0


def test_peak_flops_is_measured_once_then_cached(tmp_path) -> None:
    path, calls = tmp_path / "peak.json", []

    def fake(device: torch.device) -> float:
        calls.append(device)
        return 1.5e11

    cpu = torch.device("cpu")
    first = peak_flops(cpu, threads=1, path=path, measure=fake)
    assert (first.flops, first.source, len(calls)) == (1.5e11, "measured", 1)
    again = peak_flops(cpu, threads=1, path=path, measure=fake)
    assert (again.flops, again.source, len(calls)) == (1.5e11, "cache", 1)
    other = peak_flops(cpu, threads=2, path=path, measure=fake)     # another thread count: another key
    assert other.source == "measured" and len(calls) == 2
    stored = json.loads(path.read_text())
    assert set(stored) == {device_key(cpu, 1), device_key(cpu, 2)}
    assert f"torch={torch.__version__}" in device_key(cpu, 1) and "threads=1" in device_key(cpu, 1)
    path.write_text("{not json")                                    # a corrupt cache is measured again
    assert peak_flops(cpu, threads=1, path=path, measure=fake).source == "measured"
    assert peak_flops(cpu, threads=1, path=path, measure=fake).source == "cache"


def test_cache_dir_follows_environment(tmp_path, monkeypatch) -> None:
    from pipedream.observe.peak_flops import cache_path

    monkeypatch.setenv("PIPEDREAM_CACHE_DIR", str(tmp_path))
    assert cache_path() == tmp_path / "peak_flops.json"


def test_matmul_microbenchmark_is_plausible() -> None:
    flops = measure_matmul_flops(torch.device("cpu"), n=128, seconds=0.05)
    assert 1e8 < flops < 1e14


def test_peak_memory_on_cpu_is_resident_set() -> None:
    memory = peak_memory_bytes(torch.device("cpu"))
    assert set(memory) == {"rss"} and memory["rss"] > 10 * 2**20


def test_run_writer_logs_steps(tmp_path) -> None:
    writer = RunWriter(tmp_path)
    writer.log_step({"step": 1, "loss": 2.0})
    writer.write_summary({"steps": 1})
    writer.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 2.0}
    assert json.loads((tmp_path / "summary.json").read_text()) == {"steps": 1}


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_tensorboard_missing_is_one_clear_line() -> None:
    check_tensorboard(False)
    with pytest.raises(ConfigError, match=r"pip install tensorboard") as error:
        check_tensorboard(True)
    assert "\n" not in str(error.value)
