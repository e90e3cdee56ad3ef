"""The static image of a plotly figure: a PNG drawn with matplotlib from the figure's JSON.

A figure left in a saved notebook has to show where plotly.js does not run: nbconvert's
HTML opened offline, GitHub, nbviewer, a PDF, a mail. plotly's own static export
(kaleido) drives a Chrome it downloads, which a laptop offline or a cluster node does not
have; matplotlib draws the same figure on any machine. :func:`figure_png` draws the parts
of plotly's figure model that RaPyDLI's figures and the tour's ``plotly.express`` charts
use, each where plotly puts it:

- subplots (each axis pair at its layout ``domain``), linear, log and category axes, axis
  titles and ranges, a reversed axis;
- ``scatter`` (lines, markers, text labels, dashes, ``fill="tonexty"``/``"tozeroy"``
  bands, error bars), ``bar`` (vertical or horizontal, ``base``/``width``/``offset``,
  ``barmode`` group, stack, relative or overlay), ``box``, ``parcoords``;
- shapes (lines, rectangles) and annotations in data, axis-domain or paper coordinates,
  the title and a legend of the traces plotly would list.

Hover text, animation and 3-D are interactive-only and left out; a trace of another type
is named in a note on the image rather than dropped silently.

Examples
--------
>>> import plotly.graph_objects as go
>>> png = figure_png(go.Figure(go.Scatter(x=[1, 2, 3], y=[3, 1, 2])))
>>> png[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
True
"""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Mapping, Sequence
from typing import Any

#: Pixels per inch of the PNG; a figure keeps plotly's size in pixels (``layout.width`` x ``layout.height``).
DPI = 100
#: The size plotly gives a figure without ``layout.width``/``height`` in a notebook's output (pixels).
DEFAULT_SIZE = (900, 450)
#: plotly's default trace colours (``plotly`` template's colorway), used when the figure names none.
PLOTLY_COLORWAY = (
    "#636efa",
    "#EF553B",
    "#00cc96",
    "#ab63fa",
    "#FFA15A",
    "#19d3f3",
    "#FF6692",
    "#B6E880",
    "#FF97FF",
    "#FECB52",
)
DASHES = {"solid": "-", "dash": "--", "dot": ":", "dashdot": "-.", "longdash": "--", "longdashdot": "-."}
MARKERS = {
    "circle": "o",
    "square": "s",
    "diamond": "D",
    "cross": "P",
    "x": "X",
    "triangle-up": "^",
    "triangle-down": "v",
    "star": "*",
}
#: pixels to points (matplotlib sizes lines and fonts in points, plotly in pixels)
PT = 0.75


def figure_png(figure: Any) -> bytes:
    """The figure (a plotly ``Figure`` or its dict) drawn as a PNG of its own size in pixels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    spec = figure if isinstance(figure, Mapping) else figure.to_dict()
    layout: Mapping[str, Any] = spec.get("layout") or {}
    width, height = int(layout.get("width") or DEFAULT_SIZE[0]), int(layout.get("height") or DEFAULT_SIZE[1])
    canvas = Figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    FigureCanvasAgg(canvas)
    _Drawing(canvas, spec, width, height).draw()
    drawn = io.BytesIO()
    canvas.savefig(
        drawn, format="png", dpi=DPI, bbox_inches="tight", pad_inches=0.08
    )  # long legends, rotated labels kept whole
    return _small_png(drawn)


def _small_png(drawn: io.BytesIO) -> bytes:
    """The PNG in 256 colours (a third of its size, alike to the eye: flat colours and anti-aliased lines)."""
    from PIL import Image

    drawn.seek(0)
    small = io.BytesIO()
    Image.open(drawn).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(
        small, format="png", optimize=True
    )
    return small.getvalue()


def values(value: Any) -> list[Any]:
    """A trace's data array as a list: plotly's typed arrays (``{"dtype", "bdata"}``) decoded, numpy arrays listed."""
    if value is None:
        return []
    if isinstance(value, Mapping) and "bdata" in value:
        import numpy as np

        array = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
        if value.get("shape"):
            array = array.reshape([int(s) for s in str(value["shape"]).split(",")])
        return array.tolist()
    if hasattr(value, "tolist"):
        return list(value.tolist())
    if isinstance(value, str | int | float):
        return [value]
    return list(value)


def colour(value: Any, default: Any = None) -> Any:
    """A plotly colour (``#hex``, ``rgb(...)``/``rgba(...)``, a CSS name) as matplotlib takes it."""
    if not isinstance(value, str):
        return default if value is None or isinstance(value, list | tuple | Mapping) else value
    match = re.fullmatch(r"\s*rgba?\(([^)]*)\)\s*", value)
    if match:
        parts = [float(p) for p in match.group(1).split(",")]
        return (*(p / 255 for p in parts[:3]), parts[3] if len(parts) > 3 else 1.0)
    return value.replace(" ", "")


def plain(text: Any) -> str:
    """Annotation or title text without plotly's HTML (``<br>`` becomes a new line)."""
    text = re.sub(r"<br\s*/?>", "\n", str(text or ""))
    return (
        re.sub(r"<[^>]+>", "", text)
        .replace("&nbsp;", " ")
        .replace("&amp;", "&")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
    )


def _title(entry: Any) -> str:
    return plain(entry.get("text", "") if isinstance(entry, Mapping) else entry)


class _Drawing:
    """One figure drawn onto a matplotlib ``Figure``: its axes, traces, shapes, annotations and legend."""

    def __init__(self, canvas: Any, spec: Mapping[str, Any], width: int, height: int) -> None:
        self.canvas, self.width, self.height = canvas, width, height
        self.layout: Mapping[str, Any] = spec.get("layout") or {}
        self.traces: list[Mapping[str, Any]] = [t for t in spec.get("data") or [] if t.get("visible", True) is True]
        template = (self.layout.get("template") or {}).get("layout") or {}
        self.colorway = self.layout.get("colorway") or template.get("colorway") or PLOTLY_COLORWAY
        self.axes: dict[tuple[str, str], Any] = {}
        self.categories: dict[tuple[int, str], dict[Any, int]] = {}  # (axes id, "x"/"y") -> category -> position
        self.legend: dict[str, tuple[Any, str]] = {}
        self.unsupported: set[str] = set()
        self.last_y: dict[
            int, list[float]
        ] = {}  # (axes id) -> the y of the last trace drawn there: what a "tonexty" fill fills to
        names = [len(plain(t.get("name", ""))) for t in self.traces]
        legend_space = min(360, 60 + int(6.2 * max(names, default=0))) if self._legend_wanted() else 25
        title_space = 50 if _title(self.layout.get("title")) else 20
        margin = self.layout.get("margin") or {}
        self.area = (max(55, int(margin.get("l", 0))), legend_space,
                     max(title_space, int(margin.get("t", 0))) + 10, max(45, int(margin.get("b", 0))))  # fmt: skip

    def _legend_wanted(self) -> bool:
        shown = self.layout.get("showlegend")
        named = [t for t in self.traces if t.get("showlegend", True) and t.get("name") and t.get("type") != "parcoords"]
        return bool(named) if shown else (shown is None and len(named) > 1)

    # -- coordinates

    def paper(self, x: float, y: float) -> tuple[float, float]:
        """Paper coordinates (0..1 over the plotting area) as figure fractions."""
        left, right, top, bottom = self.area
        return (
            (left + x * (self.width - left - right)) / self.width,
            (bottom + y * (self.height - top - bottom)) / self.height,
        )

    def axes_for(self, xid: str, yid: str) -> Any:
        """The matplotlib axes of plotly's axis pair (``"x2"``, ``"y2"``), placed at the axes' domains."""
        key = (xid, yid)
        if key not in self.axes:
            xaxis, yaxis = self._axis("x", xid), self._axis("y", yid)
            (x0, x1), (y0, y1) = xaxis.get("domain", (0, 1)), yaxis.get("domain", (0, 1))
            (fx0, fy0), (fx1, fy1) = self.paper(x0, y0), self.paper(x1, y1)
            ax = self.canvas.add_axes((fx0, fy0, fx1 - fx0, fy1 - fy0))
            ax.grid(True, color="#e5e5e5", linewidth=0.8)
            ax.set_axisbelow(True)
            for spine in ("top", "right"):
                ax.spines[spine].set_visible(False)
            ax.tick_params(labelsize=8)
            self.axes[key] = ax
        return self.axes[key]

    def _axis(self, letter: str, axis_id: str) -> Mapping[str, Any]:
        return self.layout.get(f"{letter}axis{axis_id[1:]}") or {}

    def _any_axes(self, ref: str) -> Any:
        """The axes a reference such as ``"x3"`` or ``"y2 domain"`` points at (the first pair with that axis)."""
        axis_id = ref.split()[0]
        for (xid, yid), ax in self.axes.items():
            if axis_id in (xid, yid):
                return ax
        letter = axis_id[0]
        return self.axes_for(axis_id, "y") if letter == "x" else self.axes_for("x", axis_id)

    def transform(self, xref: str, yref: str) -> Any:
        """The matplotlib transform of a shape's or annotation's (``xref``, ``yref``)."""
        from matplotlib.transforms import Affine2D, blended_transform_factory

        left, right, top, bottom = self.area
        paper = Affine2D().scale((self.width - left - right) / self.width, (self.height - top - bottom) / self.height)
        paper = paper.translate(left / self.width, bottom / self.height) + self.canvas.transFigure

        def one(ref: str) -> Any:
            if ref == "paper":
                return paper
            ax = self._any_axes(ref)
            return ax.transAxes if ref.endswith("domain") else ax.transData

        return blended_transform_factory(one(xref), one(yref))

    def position(self, ax: Any, letter: str, items: Sequence[Any]) -> list[Any]:
        """Data values as positions: numbers kept, categories (strings) numbered in order of appearance on this axis."""
        if not items or all(isinstance(v, int | float) or v is None for v in items):
            return list(items)
        names = self.categories.setdefault((id(ax), letter), {})
        for item in items:
            names.setdefault(item, len(names))
        return [names[item] for item in items]

    # -- drawing

    def draw(self) -> None:
        stacks: dict[int, dict[Any, float]] = {}
        bars = [t for t in self.traces if t.get("type") == "bar"]
        for index, trace in enumerate(self.traces):
            kind = trace.get("type", "scatter")
            default = self.colorway[index % len(self.colorway)]
            if kind == "parcoords":
                self._parcoords(trace, default)
                continue
            ax = self.axes_for(trace.get("xaxis", "x"), trace.get("yaxis", "y"))
            if kind in ("scatter", "scattergl"):
                self._scatter(ax, trace, default)
            elif kind == "bar":
                self._bar(ax, trace, default, bars, stacks.setdefault(id(ax), {}))
            elif kind == "box":
                self._box(ax, trace, default)
            else:
                self.unsupported.add(kind)
        if not self.axes and not any(t.get("type") == "parcoords" for t in self.traces):
            self.axes_for("x", "y")
        for (xid, yid), ax in self.axes.items():
            self._style_axis(ax, "x", self._axis("x", xid))
            self._style_axis(ax, "y", self._axis("y", yid))
        for shape in self.layout.get("shapes") or []:
            self._shape(shape)
        for note in self.layout.get("annotations") or []:
            self._annotation(note)
        self._title_and_legend()

    def _scatter(self, ax: Any, trace: Mapping[str, Any], default: str) -> None:
        xs, ys = values(trace.get("x")), values(trace.get("y"))
        if not xs and ys:
            xs = list(range(len(ys)))
        xs, ys = self.position(ax, "x", xs), self.position(ax, "y", ys)
        mode = trace.get("mode") or ("lines+markers" if len(xs) < 20 else "lines")
        line, marker = trace.get("line") or {}, trace.get("marker") or {}
        color = colour(line.get("color") or marker.get("color"), default)
        pairs = [(x, y) for x, y in zip(xs, ys, strict=False) if x is not None and y is not None]
        handle = None
        fill = trace.get("fill")
        if fill in ("tonexty", "tozeroy") and pairs:
            below = self.last_y.get(id(ax)) if fill == "tonexty" else None
            fx = [p[0] for p in pairs]
            lower = below if below is not None and len(below) == len(fx) else [0.0] * len(fx)
            fillcolor = colour(trace.get("fillcolor"), None) or (*_rgb(color), 0.3)
            handle = ax.fill_between(fx, lower, [p[1] for p in pairs], color=fillcolor, linewidth=0)
        self.last_y[id(ax)] = [p[1] for p in pairs]
        if "lines" in mode and line.get("width", 2) != 0 and pairs:
            (handle,) = ax.plot(
                [p[0] for p in pairs],
                [p[1] for p in pairs],
                color=color,
                linewidth=PT * float(line.get("width", 2)),
                linestyle=DASHES.get(str(line.get("dash", "solid")), "-"),
                marker="o" if "markers" in mode else None,
                markersize=PT * float(marker.get("size", 6)),
            )
        elif "markers" in mode and pairs:
            colors = marker.get("color")
            point_colors = [colour(c, default) for c in values(colors)] if isinstance(colors, list | tuple) else color
            handle = ax.scatter(
                [p[0] for p in pairs],
                [p[1] for p in pairs],
                c=point_colors if isinstance(point_colors, list) else None,
                color=None if isinstance(point_colors, list) else point_colors,
                s=(PT * float(marker.get("size", 6))) ** 2,
                marker=MARKERS.get(str(marker.get("symbol", "circle")), "o"),
                zorder=3,
            )
        self._error_bars(ax, trace, xs, ys, color)
        if "text" in mode:
            for (x, y), text in zip(pairs, values(trace.get("text")), strict=False):
                ax.annotate(plain(text), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        self._legend_entry(trace, handle)

    def _error_bars(self, ax: Any, trace: Mapping[str, Any], xs: list[Any], ys: list[Any], color: Any) -> None:
        """``error_y``'s bars (``array``, and ``arrayminus`` when not symmetric) at the trace's points."""
        error = trace.get("error_y") or {}
        if error.get("array") is None or not error.get("visible", True):
            return
        up = values(error["array"])
        down = (
            values(error["arrayminus"])
            if error.get("symmetric") is False or error.get("arrayminus") is not None
            else up
        )
        ax.errorbar(
            xs,
            ys,
            yerr=[down, up],
            fmt="none",
            ecolor="#444" if trace.get("type") == "bar" else color,
            elinewidth=1,
            capsize=4,
        )

    def _bar(
        self, ax: Any, trace: Mapping[str, Any], default: str, bars: list[Mapping[str, Any]], stack: dict[Any, float]
    ) -> None:
        horizontal = trace.get("orientation") == "h"
        along, length = ("y", "x") if horizontal else ("x", "y")
        places = values(trace.get(along))
        sizes = [v if v is not None else 0 for v in values(trace.get(length))]
        if not places:
            places = list(range(len(sizes)))
        places = self.position(ax, along, places)
        mode = self.layout.get("barmode", "group")
        together = [
            t
            for t in bars
            if t.get("xaxis", "x") == trace.get("xaxis", "x") and t.get("yaxis", "y") == trace.get("yaxis", "y")
        ]
        width = trace.get("width")
        offset = trace.get("offset")
        if width is None:
            width = 0.8 / len(together) if mode == "group" and len(together) > 1 else 0.8
        if offset is None:
            place = next(i for i, t in enumerate(together) if t is trace)
            offset = -0.4 + place * width if mode == "group" and len(together) > 1 else -width / 2
        marker = trace.get("marker") or {}
        colors = marker.get("color")
        color = (
            [colour(c, default) for c in values(colors)]
            if isinstance(colors, list | tuple)
            else colour(colors, default)
        )
        if trace.get("base") is not None:
            base = [b or 0 for b in values(trace.get("base"))]
        elif mode in ("stack", "relative"):
            base = [stack.get(p, 0.0) for p in places]
            for p, s in zip(places, sizes, strict=False):
                stack[p] = stack.get(p, 0.0) + s
        else:
            base = [0.0] * len(places)
        centres = [p + offset + width / 2 for p in places]
        edge = marker.get("line") or {}
        outline = {"edgecolor": colour(edge.get("color"), "none"), "linewidth": PT * float(edge.get("width", 0))}
        if horizontal:
            handle = ax.barh(centres, sizes, height=width, left=base, color=color, **outline)
        else:
            handle = ax.bar(centres, sizes, width=width, bottom=base, color=color, **outline)
            self._error_bars(ax, trace, centres, [b + s for b, s in zip(base, sizes, strict=False)], color)
        self._legend_entry(trace, handle)

    def _box(self, ax: Any, trace: Mapping[str, Any], default: str) -> None:
        ys, xs = values(trace.get("y")), values(trace.get("x"))
        groups: dict[Any, list[float]] = {}
        for x, y in zip(xs or [trace.get("name", "")] * len(ys), ys, strict=False):
            if y is not None:
                groups.setdefault(x, []).append(y)
        places = self.position(ax, "x", list(groups))
        color = colour((trace.get("marker") or {}).get("color"), default)
        if groups:
            parts = ax.boxplot(
                list(groups.values()), positions=places, widths=0.5, patch_artist=True, manage_ticks=False
            )
            for box in parts["boxes"]:
                box.set(facecolor=(*_rgb(color), 0.3), edgecolor=color)
            self._legend_entry(trace, parts["boxes"][0])

    def _parcoords(self, trace: Mapping[str, Any], default: str) -> None:
        domain = trace.get("domain") or {}
        (x0, x1), (y0, y1) = domain.get("x", (0, 1)), domain.get("y", (0, 1))
        (fx0, fy0), (fx1, fy1) = self.paper(x0, y0), self.paper(x1, y1 - 0.08)
        ax = self.canvas.add_axes((fx0, fy0, fx1 - fx0, fy1 - fy0))
        dimensions = [d for d in trace.get("dimensions") or [] if values(d.get("values"))]
        ax.set_yticks([])
        for spine in ax.spines.values():
            spine.set_visible(False)
        if not dimensions:
            return
        columns = []
        for dim in dimensions:
            column = [float(v) for v in values(dim["values"])]
            low, high = dim.get("range") or (min(column), max(column))
            columns.append([(v - low) / (high - low) if high != low else 0.5 for v in column])
        line = trace.get("line") or {}
        shades = values(line.get("color")) if isinstance(line.get("color"), list | tuple | Mapping) else []
        import matplotlib

        scale = matplotlib.colormaps["viridis"]
        low, high = (min(shades), max(shades)) if shades else (0, 1)
        for row in range(len(columns[0])):
            shade = scale((shades[row] - low) / (high - low)) if shades and high != low else default
            ax.plot(range(len(columns)), [c[row] for c in columns], color=shade, linewidth=1, alpha=0.8)
        ax.set_xticks(range(len(columns)), [plain(d.get("label", "")) for d in dimensions], fontsize=8)
        for i in range(len(columns)):
            ax.axvline(i, color="#444", linewidth=0.8)
        ax.set_xlim(-0.1, len(columns) - 0.9)

    def _style_axis(self, ax: Any, letter: str, axis: Mapping[str, Any]) -> None:
        set_label, set_scale, set_lim = (
            (ax.set_xlabel, ax.set_xscale, ax.set_xlim)
            if letter == "x"
            else (ax.set_ylabel, ax.set_yscale, ax.set_ylim)
        )
        set_label(_title(axis.get("title")), fontsize=9)
        log = axis.get("type") == "log"
        if log:
            set_scale("log")
        if axis.get("range") and axis.get("autorange") in (None, False):
            low, high = axis["range"]
            if low is not None and high is not None:
                set_lim(10**low, 10**high) if log else set_lim(low, high)
        names = self.categories.get((id(ax), letter))
        if letter == "x" and not names and not log and self._whole_numbers(ax, letter):  # steps, epochs, workers
            from matplotlib.ticker import MaxNLocator

            (ax.xaxis if letter == "x" else ax.yaxis).set_major_locator(MaxNLocator(integer=True))
        if names:
            ticks = list(names.values())
            labels = [plain(n) for n in names]
            if letter == "x":
                ax.set_xticks(
                    ticks,
                    labels,
                    rotation=30 if sum(map(len, labels)) > 60 else 0,
                    ha="right" if sum(map(len, labels)) > 60 else "center",
                )
            else:
                ax.set_yticks(ticks, labels)
        if axis.get("autorange") == "reversed":
            (ax.invert_xaxis if letter == "x" else ax.invert_yaxis)()
        if axis.get("visible") is False or axis.get("showticklabels") is False:
            (ax.xaxis if letter == "x" else ax.yaxis).set_ticklabels([])

    def _whole_numbers(self, ax: Any, letter: str) -> bool:
        """Whether every trace drawn on ``ax`` has whole numbers along ``letter`` (then its ticks are whole numbers too)."""
        drawn = [t for t in self.traces if self.axes.get((t.get("xaxis", "x"), t.get("yaxis", "y"))) is ax]
        found = [v for t in drawn for v in values(t.get(letter)) if v is not None]
        return bool(found) and all(isinstance(v, int) or (isinstance(v, float) and v.is_integer()) for v in found)

    def _shape(self, shape: Mapping[str, Any]) -> None:
        from matplotlib.patches import Rectangle

        xref, yref = str(shape.get("xref", "x")), str(shape.get("yref", "y"))
        if not (self.axes or "paper" == xref == yref):
            return
        transform = self.transform(xref, yref)
        line = shape.get("line") or {}
        style = {"color": colour(line.get("color"), "#444"), "linewidth": PT * float(line.get("width", 2)),
                 "linestyle": DASHES.get(str(line.get("dash", "solid")), "-")}  # fmt: skip
        corners: list[Any] = [shape.get(k) for k in ("x0", "x1", "y0", "y1")]
        if None in corners:
            return
        x0, x1, y0, y1 = corners
        if shape.get("type", "line") == "line":
            self.canvas.add_artist(_line([x0, x1], [y0, y1], transform, style))
        elif shape.get("type") == "rect":
            fill = colour(shape.get("fillcolor"), "none")
            rect = Rectangle(
                (x0, y0),
                x1 - x0,
                y1 - y0,
                transform=transform,
                facecolor=fill,
                alpha=float(shape.get("opacity", 1)),
                edgecolor=style["color"] if line.get("width", 1) else "none",
                linewidth=style["linewidth"],
            )
            self.canvas.add_artist(rect)

    def _annotation(self, note: Mapping[str, Any]) -> None:
        xref, yref = str(note.get("xref", "x")), str(note.get("yref", "y"))
        if not (self.axes or "paper" == xref == yref):
            return
        text = plain(note.get("text", ""))
        if not text:
            return
        font = note.get("font") or {}
        ha = {"left": "left", "right": "right"}.get(str(note.get("xanchor")), "center")
        va = {"top": "top", "bottom": "bottom", "middle": "center"}.get(
            str(note.get("yanchor")), "center" if note.get("showarrow", True) else "bottom"
        )
        self.canvas.text(
            note.get("x", 0.5),
            note.get("y", 0.5),
            text,
            transform=self.transform(xref, yref),
            ha=ha,
            va=va,
            fontsize=PT * float(font.get("size", 12)),
            color=colour(font.get("color"), "#2a3f5f"),
        )

    def _title_and_legend(self) -> None:
        left, right, top, _ = self.area
        title = _title(self.layout.get("title"))
        if title:
            self.canvas.text(
                left / self.width, 1 - 12 / self.height, title, ha="left", va="top", fontsize=12, color="#2a3f5f"
            )
        if self.legend and self._legend_wanted():
            handles, labels = zip(*self.legend.values(), strict=True)
            legend_title = _title((self.layout.get("legend") or {}).get("title"))
            self.canvas.legend(
                handles,
                labels,
                loc="upper left",
                bbox_to_anchor=(1 - (right - 8) / self.width, 1 - top / self.height),
                fontsize=8,
                frameon=False,
                title=legend_title or None,
                title_fontsize=8,
            )
        if self.unsupported:
            self.canvas.text(
                0.99,
                0.01,
                "not drawn here: " + ", ".join(sorted(self.unsupported)) + " traces (open the interactive figure)",
                ha="right",
                va="bottom",
                fontsize=7,
                color="#888",
            )

    def _legend_entry(self, trace: Mapping[str, Any], handle: Any) -> None:
        name = trace.get("name")
        if handle is None or not name or trace.get("showlegend") is False:
            return
        key = str(trace.get("legendgroup") or name)
        self.legend.setdefault(key, (handle, plain(name)))


def _rgb(color: Any) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    try:
        return to_rgb(color)
    except ValueError:
        return (0.4, 0.4, 0.4)


def _line(xs: list[Any], ys: list[Any], transform: Any, style: Mapping[str, Any]) -> Any:
    from matplotlib.lines import Line2D

    return Line2D(xs, ys, transform=transform, **style)
