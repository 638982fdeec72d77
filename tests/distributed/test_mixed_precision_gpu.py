"""Mixed precision on CUDA (marked gpu: skipped without CUDA; run with `scripts/test.sh -m gpu`):
autocast on the cuda device type, the CUDA allocator's statistics in the summary, NCCL."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipedream.numerics.precision import MixedPrecision
from tests.support.precision_harness import train_on_cuda
from tests.support.training_harness import TINY_GPT
from tests.support.workers import run_workers

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_computes_in_the_compute_dtype_on_cuda(name, dtype):
    precision = MixedPrecision(name, "cuda")
    layer = nn.Linear(8, 8).cuda()
    precision.apply([layer])
    with precision.autocast():
        out = layer(torch.randn(4, 8, device="cuda"))
    assert out.dtype == dtype and layer.weight.dtype == torch.float32
    out.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_training_on_cuda_reports_allocator_peaks(tmp_path, precision):
    overrides = TINY_GPT + ["train.steps=4", "parallel.pp=1", f"precision={precision}"]
    (result,) = run_workers(train_on_cuda, 1, overrides, str(tmp_path / precision))
    summary = result["summary"]
    assert result["device"].startswith("cuda")
    assert math.isfinite(summary["final_train_loss"])
    assert summary["ranks"][0]["peak_memory_bytes"]["allocated"] > 0
    assert (result["loss_scaler"] is not None) == (precision == "fp16")


def test_traced_iterations_on_cuda_time_the_device_work(tmp_path):
    overrides = TINY_GPT + ["train.steps=6", "parallel.pp=1", "precision=bf16", "trace.enabled=true",
                            "trace.steps=[4,5]", "trace.timeline=false"]
    (result,) = run_workers(train_on_cuda, 1, overrides, str(tmp_path / "traced"))
    assert result["summary"]["trace"] is not None
