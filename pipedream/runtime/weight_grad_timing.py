"""When a backward's weight-gradient GEMMs run: the Linear layers' dW, which a backward can leave in
the stage's ``WeightGradQueue`` (``models.grad_accumulation``) instead of running them itself.

The executor settles it once per ``run`` from the action list and the weight source, and its
handlers ask the answer what to do at each backward and send.
"""
from __future__ import annotations

import enum


class WeightGradTiming(enum.Enum):
    # the backward runs them itself: weight versions (a weight store) take their gradients at the
    # backward's end, and without ``weight_grads_after_send`` nothing is gained by waiting
    IN_BACKWARD = "in the backward"
    # after the backward's input-gradient send (``weight_grads_delay`` sends later), so the previous
    # stage starts its backward sooner; a chunk that sends no gradient holds them until its next
    # activation send where ``schedules.weight_hold`` says so, else runs them in the backward
    AFTER_SEND = "after the input-gradient send"
    # the list has WEIGHT actions (split backwards): a BWD computes the input gradient only and
    # its W runs the rest
    AT_WEIGHT_ACTION = "at the WEIGHT action"

    @classmethod
    def choose(cls, weight_actions: bool, after_send: bool, weight_versions: bool) -> WeightGradTiming:
        """``weight_actions``: the action list has WEIGHT actions; ``after_send``: the executor's
        ``weight_grads_after_send``; ``weight_versions``: the run has a weight store."""
        if weight_versions:
            return cls.IN_BACKWARD
        if weight_actions:
            return cls.AT_WEIGHT_ACTION
        return cls.AFTER_SEND if after_send else cls.IN_BACKWARD

    @property
    def splits_backward(self) -> bool:
        """Whether a BWD is the input gradient only (``Stage.backward(split=True)``)."""
        return self is WeightGradTiming.AT_WEIGHT_ACTION

    @property
    def runs_after_sends(self) -> bool:
        """Whether the executor runs queued GEMMs after sends (and before the gradient sync)."""
        return self is WeightGradTiming.AFTER_SEND

    def defers(self, first_chunk: bool, held_until_activation_send: bool) -> bool:
        """Whether a backward leaves its GEMMs in the queue for a later send to run: any chunk but
        the first virtual stage, and that one where ``schedules.weight_hold`` holds them."""
        return self is WeightGradTiming.AFTER_SEND and (not first_chunk or held_until_activation_send)
