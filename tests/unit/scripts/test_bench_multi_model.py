"""The fused-model benchmark's arithmetic bound: the layers timed alone, and the ceiling read from them."""
from __future__ import annotations

from scripts.bench.multi_model import MODEL, arithmetic_bound, layer_arithmetic


def test_the_ceiling_is_the_sequential_step_against_the_fused_layers_alone():
    # 2 models of 8 samples: sequential 200 samples/s of both = a 40 ms step per model; fused layers 50 ms
    data = {"models": 2, "arithmetic": {"single_s": 0.03, "fused_s": 0.05, "repeats": 7},
            "modes": {"sequential": {"samples_per_s": 200.0}},
            "by_round": [{"sequential": {"runs": [{"samples_per_step": 8}]}}]}
    text = arithmetic_bound(data)
    assert "one model 30.00 ms, 75% of its training step in the sequential run (40.00 ms)" in text
    assert "the 2 fused 50.00 ms, 0.83x their 2 separate passes" in text
    assert "would reach 1.60x the sequential rate" in text   # 16 samples / 50 ms = 320 samples/s
    assert "median of 7 passes" in text
    assert arithmetic_bound({"models": 2}) == ""


def test_the_layers_are_timed_alone_and_fused():
    timing = layer_arithmetic(MODEL, 2, repeats=1)
    assert timing["repeats"] == 1
    assert 0 < timing["single_s"] and 0 < timing["fused_s"]
