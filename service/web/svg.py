"""A small SVG writer for the dashboard's server-drawn figures: elements as escaped text,
a linear scale and round axis ticks. No drawing library: the figures are a few hundred
rectangles and lines, and SVG text is searchable and testable."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

FONT = "font-family='system-ui, sans-serif'"


def attrs(**values: object) -> str:
    """``key='value'`` pairs, escaped; ``class_`` is written ``class``, ``_`` in a name ``-``."""
    parts = []
    for key, value in values.items():
        if value is None:
            continue
        name = "class" if key == "class_" else key.replace("_", "-")
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        parts.append(f"{name}='{escape(text, quote=True)}'")
    return " ".join(parts)


@dataclass
class Svg:
    """An SVG document of ``width`` x ``height`` user units, drawn element by element; it
    scales to its container's width (``viewBox``)."""

    width: float
    height: float
    label: str
    data: dict[str, object] = field(default_factory=dict)
    """``data-*`` attributes of the root element (what tests and scripts read)."""
    parts: list[str] = field(default_factory=list)

    def rect(self, x: float, y: float, w: float, h: float, fill: str, **more: object) -> None:
        self.parts.append(
            f"<rect {attrs(x=x, y=y, width=max(w, 0.0), height=h, fill=fill, **more)}/>"
        )

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str, **more: object) -> None:
        self.parts.append(f"<line {attrs(x1=x1, y1=y1, x2=x2, y2=y2, stroke=stroke, **more)}/>")

    def text(self, x: float, y: float, content: str, size: float = 11, **more: object) -> None:
        self.parts.append(
            f"<text {attrs(x=x, y=y, font_size=size, **more)} {FONT}>{escape(content)}</text>"
        )

    def title(self, content: str) -> None:
        """A tooltip for the element drawn last (browsers show ``<title>`` on hover)."""
        if self.parts and self.parts[-1].endswith("/>"):
            last = self.parts.pop()[: -len("/>")]
            tag = last[1:].split(" ", 1)[0]
            self.parts.append(f"{last}><title>{escape(content)}</title></{tag}>")

    def render(self, class_: str = "", fill: bool = True) -> str:
        """The document; ``fill``: as wide as its container, else its own width at most."""
        data = {f"data_{k}": v for k, v in self.data.items()}
        root = attrs(
            xmlns="http://www.w3.org/2000/svg",
            viewBox=f"0 0 {self.width:.0f} {self.height:.0f}",
            width="100%" if fill else f"{self.width:.0f}",
            role="img",
            aria_label=self.label,
            class_=class_ or None,
            **data,
        )
        return f"<svg {root}>" + "".join(self.parts) + "</svg>"


@dataclass(frozen=True)
class Scale:
    """A linear map from ``[lo, hi]`` (data) to ``[start, end]`` (user units)."""

    lo: float
    hi: float
    start: float
    end: float

    def __call__(self, value: float) -> float:
        span = self.hi - self.lo
        return (
            self.start + (value - self.lo) / span * (self.end - self.start) if span else self.start
        )


def nice_ticks(hi: float, count: int = 6) -> list[float]:
    """Round tick values from 0 to at least ``hi`` (steps of 1, 2 or 5 x 10^k)."""
    if not hi > 0 or not math.isfinite(hi):
        return [0.0]
    raw = hi / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    n = math.ceil(hi / step - 1e-9)
    return [i * step for i in range(n + 1)]


def tick_label(value: float) -> str:
    """A tick's number without needless digits (``0``, ``2.5``, ``1200``)."""
    return f"{value:.6g}"
