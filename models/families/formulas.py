"""Closed-form parameter and FLOP counts: GPT (dissertation ch. 4.5.1) and the residual MLP.

These are the formulas the planner uses for models far too large to build; tests check them
against parameters counted on the real (small) models. ``models.facts`` applies them to a config.
"""
from __future__ import annotations


def gpt_parameters(num_layers: int, hidden: int, vocab: int, seq_len: int) -> int:
    """Eq. 4.3: P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)) = 12lh^2 + 13lh + (V+s)h.

    Counts the transformer blocks (QKV, projection, 4h MLP, two LayerNorms, all with biases),
    the token embedding (shared with the output head) and the learned positions. The final
    LayerNorm's 2h parameters are not in the formula.
    """
    l, h = num_layers, hidden
    return 12 * l * h * h + 13 * l * h + (vocab + seq_len) * h


def gpt_flops_per_iteration(batch: int, num_layers: int, hidden: int, vocab: int, seq_len: int,
                            recompute: bool = True) -> float:
    """Eq. 4.2: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), with full activation recomputation.

    Without recomputation the extra forward pass is gone: the transformer term is 3/4 of it
    (72 B s l h^2 (1 + s/(6h))) while the logit layer's 6BshV is unchanged.
    """
    b, s, l, h, v = batch, seq_len, num_layers, hidden, vocab
    passes = 4 if recompute else 3
    transformer = passes * 24 * b * s * l * h * h * (1 + s / (6 * h))
    logits = 6 * b * s * h * v
    return float(transformer + logits)


def mlp_block_forward_flops(hidden: int) -> float:
    """One residual block of ``models.families.mlp``: two h x h GEMMs, 2 FLOPs per multiply-add (biases and
    GELU ignored)."""
    return float(2 * 2 * hidden * hidden)


def mlp_flops_per_iteration(batch: int, num_layers: int, hidden: int, recompute: bool = False) -> float:
    """The forward, a backward of twice its FLOPs (input and weight gradients) and, with
    recomputation, the forward again: the familiar 6 x parameters x samples (8 x with recompute)."""
    passes = 4 if recompute else 3
    return float(passes * batch * num_layers * mlp_block_forward_flops(hidden))


def training_days(tokens: float, parameters: float, num_devices: int, flops_per_device: float) -> float:
    """Eq. 4.4: end-to-end training time ~ 8 T P / (n X), returned in days."""
    seconds = 8.0 * tokens * parameters / (num_devices * flops_per_device)
    return seconds / 86400.0
