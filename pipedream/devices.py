"""Accelerator data sheets: memory, dense peak FLOP/s per precision from the vendors' sheets,
memory bandwidth, and the achievable GEMM fraction the planner's analytic profiles use. The
planner sizes clusters with them and the runtime takes a known GPU's peak from them as the
denominator of MFU; both import them from here (standard library only).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

GIB = 1024**3
TFLOPS = 1e12


@dataclass(frozen=True)
class DeviceSheet:
    """One accelerator type. ``peak_flops`` maps precision -> dense peak FLOP/s."""

    name: str
    memory_bytes: float
    peak_flops: Mapping[str, float]
    memory_bandwidth: float  # bytes/s of device memory (HBM, GDDR, DRAM)
    default_precision: str = "fp32"
    matmul_efficiency: float = 0.7  # best fraction of peak a large GEMM reaches
    half_efficiency_flops: float = 2e9  # GEMM size (FLOPs) that reaches half of matmul_efficiency

    def flops(self, precision: str) -> float:
        """Peak FLOP/s at ``precision``; falls back to fp32 where the sheet has no entry."""
        if precision in self.peak_flops:
            return self.peak_flops[precision]
        return self.peak_flops["fp32"]


def _sheet(name: str, mem_gib: float, peaks: dict[str, float], bw_gbs: float, default: str,
           eff: float, half: float) -> DeviceSheet:
    return DeviceSheet(name, mem_gib * GIB, MappingProxyType({k: v * TFLOPS for k, v in peaks.items()}),
                       bw_gbs * 1e9, default, eff, half)


# Vendor data sheets (dense, no sparsity): A100 (2020), V100 SXM2 (2017), H100/H200 SXM (2022/23),
# GTX 1080 Ti (2017). The A100's efficiency is fitted so that the GPT presets at Table 4.1's (t, p),
# with recomputation as the paper ran them, land within 10% of its TFLOP/s (hardware FLOPs, eq. 4.2).
DEVICES: Mapping[str, DeviceSheet] = MappingProxyType({
    "a100_40gb": _sheet("a100_40gb", 40, {"fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312},
                        1555, "bf16", 0.60, 1.2e10),
    "a100_80gb": _sheet("a100_80gb", 80, {"fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312},
                        2039, "bf16", 0.60, 1.2e10),
    "v100_16gb": _sheet("v100_16gb", 16, {"fp32": 15.7, "fp16": 125}, 900, "fp16", 0.7, 2e9),
    "v100_32gb": _sheet("v100_32gb", 32, {"fp32": 15.7, "fp16": 125}, 900, "fp16", 0.7, 2e9),
    "h100_80gb": _sheet("h100_80gb", 80, {"fp32": 67, "tf32": 495, "fp16": 989, "bf16": 989, "fp8": 1979},
                        3350, "bf16", 0.7, 1e10),
    "h200": _sheet("h200", 140, {"fp32": 67, "tf32": 495, "fp16": 989, "bf16": 989, "fp8": 1979},
                   4800, "bf16", 0.7, 1e10),
    "gtx_1080ti": _sheet("gtx_1080ti", 11, {"fp32": 11.3, "fp16": 0.177}, 484, "fp32", 0.8, 1e9),
    # The older types of Gavel's clusters (dissertation ch. 5.7.1). Tesla P100 PCIe 16 GB data sheet
    # (2016): 9.3 TFLOP/s fp32, 18.7 fp16, 732 GB/s HBM2. Tesla K80 data sheet (2014): one board is
    # two GK210 GPUs with 8.73 TFLOP/s fp32 (boost), 24 GB and 480 GB/s together, so 4.37 TFLOP/s,
    # 12 GB and 240 GB/s per GPU (the unit a scheduler hands out); Kepler has no faster fp16.
    # GEMM efficiencies are the V100's (0.7, 2e9), not measured on these parts.
    "p100_16gb": _sheet("p100_16gb", 16, {"fp32": 9.3, "fp16": 18.7}, 732, "fp16", 0.7, 2e9),
    "k80": _sheet("k80", 12, {"fp32": 4.37}, 240, "fp32", 0.7, 2e9),
})
