"""The built-in training step of ``gpu-worker run``: a small CNN trained with SGD.

It exists to show the feed under a real optimiser loop, not to reach an accuracy.
"""

from __future__ import annotations

import torch
from torch import nn

MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def small_cnn(classes: int = 1000) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 5, stride=2, padding=2),
        nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, classes),
    )


class DemoStep:
    """``step(images, labels) -> loss``; builds its model on the device of the first batch."""

    def __init__(self) -> None:
        self._model: nn.Module | None = None
        self._opt: torch.optim.Optimizer | None = None

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        if self._model is None or self._opt is None:
            self._model = small_cnn().to(images.device)
            self._opt = torch.optim.SGD(self._model.parameters(), lr=0.05, momentum=0.9)
        mean = torch.tensor(MEAN, device=images.device).view(1, 3, 1, 1)
        std = torch.tensor(STD, device=images.device).view(1, 3, 1, 1)
        x = (images.float() - mean) / std
        loss = nn.functional.cross_entropy(self._model(x), labels)
        self._opt.zero_grad(set_to_none=True)
        loss.backward()
        self._opt.step()
        return float(loss.detach())


step = DemoStep()
