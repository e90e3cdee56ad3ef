"""The convolution problem being tuned: :class:`ConvShape`."""

from __future__ import annotations

from dataclasses import dataclass, replace

from rapydli.errors import ConfigError

LAYOUTS = ("nchw", "nhwc")


@dataclass(frozen=True)
class ConvShape:
    """One 2-D convolution: input ``(n, c, h, w)``, ``k`` filters of ``r x s``, square stride, padding and dilation.

    ``groups`` splits the channels: each of ``k / groups`` filters of a group reads ``c / groups``
    input channels (``groups == c == k``: a depthwise convolution); the weight is
    ``(k, c / groups, r, s)``. ``dilation`` spaces the filter taps (a 3x3 filter of dilation 2
    covers 5x5).

    Example
    -------
    >>> ConvShape(8, 64, 56, 56, 64, 3, 3, stride=1, pad=1).out_hw
    (56, 56)
    >>> ConvShape(8, 64, 56, 56, 64, 3, 3, pad=2, dilation=2, groups=64).weight_shape
    (64, 1, 3, 3)
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
    groups: int = 1
    dilation: int = 1

    def __post_init__(self) -> None:
        for name in ("n", "c", "h", "w", "k", "r", "s", "stride", "groups", "dilation"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"ConvShape.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.pad, int) or self.pad < 0:
            raise ConfigError(f"ConvShape.pad must be a non-negative integer, got {self.pad!r}")
        if self.c % self.groups or self.k % self.groups:
            raise ConfigError(f"ConvShape.groups ({self.groups}) must divide both c ({self.c}) and k ({self.k})")
        if self.h + 2 * self.pad < self.span_r or self.w + 2 * self.pad < self.span_s:
            raise ConfigError(
                f"ConvShape: the {self.span_r}x{self.span_s} filter (dilation included) is larger "
                f"than the padded {self.h}x{self.w} input"
            )

    @classmethod
    def parse(cls, text: str) -> ConvShape:
        """``"N,C,H,W,K,R,S[,stride,pad[,groups,dilation]]"`` -> ConvShape (ConfigError naming the field otherwise)."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) not in (7, 8, 9, 10, 11) or not all(p.isdigit() for p in parts):
            raise ConfigError(
                f"--shape must be N,C,H,W,K,R,S[,stride,pad[,groups,dilation]] with integers, got {text!r}"
            )
        return cls(*(int(p) for p in parts))

    @property
    def span_r(self) -> int:
        """Rows the filter covers (``r`` taps ``dilation`` apart)."""
        return self.dilation * (self.r - 1) + 1

    @property
    def span_s(self) -> int:
        """Columns the filter covers (``s`` taps ``dilation`` apart)."""
        return self.dilation * (self.s - 1) + 1

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        """``(k, c / groups, r, s)``: the shape of ``nn.Conv2d.weight``."""
        return self.k, self.c // self.groups, self.r, self.s

    @property
    def out_hw(self) -> tuple[int, int]:
        """Output height and width."""
        return (
            (self.h + 2 * self.pad - self.span_r) // self.stride + 1,
            (self.w + 2 * self.pad - self.span_s) // self.stride + 1,
        )

    @property
    def flops(self) -> int:
        """Multiply-adds x 2 of the forward pass."""
        oh, ow = self.out_hw
        return 2 * self.n * self.k * oh * ow * (self.c // self.groups) * self.r * self.s

    def train_flops(self) -> int:
        """FLOPs of forward + data gradient + weight gradient (3x the forward)."""
        return 3 * self.flops

    @property
    def text(self) -> str:
        """``n,c,h,w,k,r,s,stride,pad`` and, when not 1, ``g<groups>`` and ``d<dilation>`` (for tables).

        Example
        -------
        >>> ConvShape(8, 64, 8, 8, 64, 3, 3, 1, 1, groups=64).text
        '8,64,8,8,64,3,3,1,1 g64'
        """
        extra = "".join(f" {tag}{v}" for tag, v in (("g", self.groups), ("d", self.dilation)) if v != 1)
        return f"{self.n},{self.c},{self.h},{self.w},{self.k},{self.r},{self.s},{self.stride},{self.pad}{extra}"

    @property
    def key(self) -> str:
        """Stable text key used by the cache (every field, groups and dilation included)."""
        return (
            f"conv2d:{self.n},{self.c},{self.h},{self.w},{self.k},{self.r},{self.s},{self.stride},{self.pad},"
            f"{self.groups},{self.dilation}"
        )

    def with_batch(self, n: int) -> ConvShape:
        """The same layer with batch size ``n``."""
        return replace(self, n=n)

    def validation_shape(self) -> ConvShape:
        """A small instance of this layer (batch 1, small spatial size) for correctness checks."""
        h = min(self.h, max(self.span_r + 2 * self.stride + 1, 7))
        w = min(self.w, max(self.span_s + 2 * self.stride + 2, 8))
        return replace(self, n=1, h=h, w=w)
