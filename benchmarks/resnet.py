"""The models ``benchmarks.gpu`` trains: torchvision's ResNets where torchvision is installed, else
the same architectures written here (He et al. 2015, v1.5: the stride on the 3x3 of a bottleneck, as
torchvision does), so the step costs what a user's ResNet step costs either way. ``tiny`` is a
two-stage ResNet for ``--device cpu --quick``, which only checks that the code runs."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
from torch import nn

CLASSES = 1000


class Basic(nn.Module):
    expansion = 1

    def __init__(self, inp: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * self.expansion
        self.body = nn.Sequential(
            conv_bn(inp, width, 3, stride), nn.ReLU(inplace=True), conv_bn(width, out, 3, 1)
        )
        self.skip = _shortcut(inp, out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inp: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * self.expansion
        self.body = nn.Sequential(
            conv_bn(inp, width, 1, 1), nn.ReLU(inplace=True),
            conv_bn(width, width, 3, stride), nn.ReLU(inplace=True),
            conv_bn(width, out, 1, 1),
        )  # fmt: skip
        self.skip = _shortcut(inp, out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


Block = type[Basic] | type[Bottleneck]


def conv_bn(inp: int, out: int, kernel: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inp, out, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(out))


def _shortcut(inp: int, out: int, stride: int) -> nn.Module:
    return nn.Identity() if inp == out and stride == 1 else conv_bn(inp, out, 1, stride)


def resnet(block: Block, depths: tuple[int, ...], widths: tuple[int, ...]) -> nn.Module:
    layers: list[nn.Module] = [conv_bn(3, widths[0], 7, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    inp = widths[0]
    for stage, (depth, width) in enumerate(zip(depths, widths, strict=True)):
        for i in range(depth):
            layers.append(block(inp, width, 2 if i == 0 and stage > 0 else 1))
            inp = width * block.expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inp, CLASSES)]
    return nn.Sequential(*layers)


def _own(name: str) -> Callable[[], nn.Module]:
    shapes: dict[str, tuple[Block, tuple[int, ...], tuple[int, ...]]] = {
        "resnet18": (Basic, (2, 2, 2, 2), (64, 128, 256, 512)),
        "resnet50": (Bottleneck, (3, 4, 6, 3), (64, 128, 256, 512)),
        "tiny": (Basic, (1, 1), (8, 16)),
    }
    block, depths, widths = shapes[name]
    return lambda: resnet(block, depths, widths)


MODELS = ("resnet50", "resnet18", "tiny")


def make_model(name: str) -> tuple[nn.Module, str]:
    """The model and where it came from ("torchvision" or "benchmarks.resnet")."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: one of {', '.join(MODELS)}")
    if name != "tiny" and importlib.util.find_spec("torchvision") is not None:
        import torchvision.models

        return getattr(torchvision.models, name)(num_classes=CLASSES), "torchvision"
    return _own(name)(), "benchmarks.resnet"
