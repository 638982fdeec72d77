"""The bottom of the call path in docs/design.md ("The call path from train.run to a layer"):
``Executor.run`` reaches a layer's forward through its FWD handler and ``Stage.forward`` only."""
from __future__ import annotations

import sys

import torch
from torch import nn

from models.spec import PipelineSequential
from pipedream.runtime.executor import Executor
from pipedream.runtime.stage import Stage
from pipedream.schedules import build_schedule


def project_frames_above(layer: nn.Module, run) -> list[str]:
    """The project's functions on the stack when ``layer``'s forward starts, innermost first."""
    seen: list[list[str]] = []

    def record(module: nn.Module, args: tuple) -> None:
        frame, names = sys._getframe(1), []
        while frame is not None:
            if "/torch/" not in frame.f_code.co_filename:
                names.append(frame.f_code.co_qualname)
            frame = frame.f_back
        seen.append(names)

    layer.register_forward_pre_hook(record)
    run()
    return seen[0]


def test_a_layer_is_two_calls_below_executor_run() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    stage = Stage([PipelineSequential(layer, nn.Linear(4, 2))], [True], [True], nn.MSELoss())
    executor = Executor(stage, None, lambda: None, lambda: None, sends_before_sync=True,
                        weight_grads_after_send=True, weight_grads_delay=1)
    batches = {mb: (torch.randn(3, 4), torch.randn(3, 2)) for mb in range(2)}
    actions = build_schedule("1f1b", 1, 2)[0]
    frames = project_frames_above(layer, lambda: executor.run(actions, batches, loss_scale=0.5))
    assert frames[:3] == ["Stage.forward", "Executor._forward", "Executor.run"]
