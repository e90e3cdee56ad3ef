"""The convolution problem being tuned: :class:`ConvShape`."""

from __future__ import annotations

from dataclasses import dataclass

from rapydli.errors import ConfigError

LAYOUTS = ("nchw", "nhwc")


@dataclass(frozen=True)
class ConvShape:
    """One 2-D convolution: input ``(n, c, h, w)``, ``k`` filters of ``r x s``, square stride and padding.

    Example
    -------
    >>> ConvShape(8, 64, 56, 56, 64, 3, 3, stride=1, pad=1).out_hw
    (56, 56)
    """

    n: int
    c: int
    h: int
    w: int
    k: int
    r: int
    s: int
    stride: int = 1
    pad: int = 0

    def __post_init__(self) -> None:
        for name in ("n", "c", "h", "w", "k", "r", "s", "stride"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"ConvShape.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.pad, int) or self.pad < 0:
            raise ConfigError(f"ConvShape.pad must be a non-negative integer, got {self.pad!r}")
        if self.h + 2 * self.pad < self.r or self.w + 2 * self.pad < self.s:
            raise ConfigError(f"ConvShape: the {self.r}x{self.s} filter is larger than the padded {self.h}x{self.w} input")

    @classmethod
    def parse(cls, text: str) -> ConvShape:
        """``"N,C,H,W,K,R,S[,stride,pad]"`` -> ConvShape (ConfigError naming the field otherwise)."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) not in (7, 8, 9) or not all(p.isdigit() for p in parts):
            raise ConfigError(f"--shape must be N,C,H,W,K,R,S[,stride,pad] with integers, got {text!r}")
        return cls(*(int(p) for p in parts))

    @property
    def out_hw(self) -> tuple[int, int]:
        """Output height and width."""
        return (self.h + 2 * self.pad - self.r) // self.stride + 1, (self.w + 2 * self.pad - self.s) // self.stride + 1

    @property
    def flops(self) -> int:
        """Multiply-adds x 2 of the forward pass."""
        oh, ow = self.out_hw
        return 2 * self.n * self.k * oh * ow * self.c * self.r * self.s

    def train_flops(self) -> int:
        """FLOPs of forward + data gradient + weight gradient (3x the forward)."""
        return 3 * self.flops

    @property
    def key(self) -> str:
        """Stable text key used by the cache."""
        return f"conv2d:{self.n},{self.c},{self.h},{self.w},{self.k},{self.r},{self.s},{self.stride},{self.pad}"

    def with_batch(self, n: int) -> ConvShape:
        """The same layer with batch size ``n``."""
        return ConvShape(n, self.c, self.h, self.w, self.k, self.r, self.s, self.stride, self.pad)

    def validation_shape(self) -> ConvShape:
        """A small instance of this layer (batch 1, small spatial size) for correctness checks."""
        h = min(self.h, max(self.r + 2 * self.stride + 1, 7))
        w = min(self.w, max(self.s + 2 * self.stride + 2, 8))
        return ConvShape(1, self.c, h, w, self.k, self.r, self.s, self.stride, self.pad)
