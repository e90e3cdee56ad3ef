"""A small model with dropout in every block, for the activation-checkpointing tests (imported on the ranks too)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset


class DropoutBlock(nn.Module):
    """A residual MLP block with dropout; ``calls`` counts its forwards (a recomputation is one more)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc, self.drop = nn.LayerNorm(width), nn.Linear(width, width), nn.Dropout(0.3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.drop(F.gelu(self.fc(self.norm(x))))


class DropoutNet(nn.Module):
    """``embed``, four :class:`DropoutBlock` in a ``ModuleList``, ``head``: no ``pipeline_blocks``, so its blocks are its children."""

    def __init__(self, features: int = 8, width: int = 16, classes: int = 3, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(DropoutBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def dropout_net() -> DropoutNet:
    torch.manual_seed(0)
    return DropoutNet()


def features() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(48, 8, generator=g), torch.randint(0, 3, (48,), generator=g)
    return TensorDataset(x[:40], y[:40]), TensorDataset(x[40:], y[40:])


class ResidualBlock(nn.Module):
    """ResNet's basic block: conv, BatchNorm, ReLU, conv, BatchNorm, plus the input."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class TinyResNet(nn.Module):
    """``stem`` (conv + BatchNorm), two :class:`ResidualBlock` in a ``ModuleList``, ``head``: BatchNorm in every block."""

    def __init__(self, channels: int = 4, classes: int = 3, depth: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.ModuleList(ResidualBlock(channels) for _ in range(depth))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def resnet() -> TinyResNet:
    torch.manual_seed(0)
    return TinyResNet()


def images() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(48, 1, 6, 6, generator=g), torch.randint(0, 3, (48,), generator=g)
    return TensorDataset(x[:40], y[:40]), TensorDataset(x[40:], y[40:])
