"""Small hand-written SVG charts for benchmarks/results/README.md (no matplotlib).

Two shapes: grouped horizontal bars (one group per category, one bar per series; linear or
log scale, an optional reference line) and stacked horizontal bars (one bar per row, one
segment per part). Both return a complete SVG document as text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from xml.sax.saxutils import escape

PALETTE = ["#4269d0", "#efb118", "#ff725c", "#6cc5b0", "#3ca951", "#ff8ab7", "#a463f2",
           "#97bbf5", "#9c6b4e", "#9498a0"]
FONT = 'font-family="Helvetica, Arial, sans-serif"'


def _esc(text: object) -> str:
    return escape(str(text), {'"': "&quot;"})


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}".rstrip("0").rstrip(".")
    if a >= 0.01:
        return f"{v:.3g}"
    return f"{v:.2g}"


def _nice_ticks(vmax: float, n: int = 5) -> list[float]:
    if vmax <= 0:
        return [0.0, 1.0]
    raw = vmax / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    ticks, t = [], 0.0
    while t < vmax * 1.0001 + step:
        ticks.append(round(t, 12))
        if t >= vmax:
            break
        t += step
    return ticks


def _log_ticks(vmin: float, vmax: float) -> list[float]:
    lo, hi = math.floor(math.log10(vmin)), math.ceil(math.log10(vmax))
    return [10.0 ** e for e in range(lo, hi + 1)]


def _text_width(labels: Sequence[str], size: int = 12) -> int:
    """A generous estimate of the rendered width of the longest label (Helvetica)."""
    return int(max((len(str(s)) for s in labels), default=0) * size * 0.6)


def _text(x: float, y: float, s: object, *, size: int = 12, anchor: str = "start",
          color: str = "#222", weight: str = "normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'fill="{color}" font-weight="{weight}" {FONT}>{_esc(s)}</text>')


def _legend(series: Sequence[str], colors: Sequence[str], x0: float, y: float,
            width: float) -> tuple[list[str], float]:
    out, x = [], x0
    for name, color in zip(series, colors):
        w = 18 + 7 * len(name) + 16
        if x + w > width and x > x0:
            x, y = x0, y + 18
        out.append(f'<rect x="{x:.1f}" y="{y - 10:.1f}" width="12" height="12" fill="{color}"/>')
        out.append(_text(x + 16, y, name, size=12))
        x += w
    return out, y


def grouped_bars(title: str, categories: Sequence[str], series: Sequence[str],
                 values: Mapping[tuple[str, str], float | None], *, unit: str = "",
                 log: bool = False, reference: tuple[float, str] | None = None,
                 missing_label: str = "n/a", labels: Mapping[tuple[str, str], str] | None = None,
                 width: int = 760, label_width: int = 250, colors: Sequence[str] | None = None,
                 ) -> str:
    """Horizontal bars: for each category a group with one bar per series. ``values`` maps
    (category, series) to a number or None (drawn as ``missing_label``); a pair absent
    from ``values`` draws nothing. ``labels`` overrides the text after a bar."""
    colors = list(colors or PALETTE)
    labels = labels or {}
    bar_h, gap, group_gap = 14, 3, 14
    present = [v for v in values.values() if v is not None and v > 0]
    vmax = max(present + ([reference[0]] if reference else []), default=1.0)
    if log:
        vmin = min(present + ([reference[0]] if reference else []), default=0.1)
        upper = vmax * 1.6
        ticks = [t for t in _log_ticks(vmin, vmax) if t <= upper]
        lo, hi = math.log10(ticks[0]), math.log10(upper)
        hi = hi if hi > lo else lo + 1
    else:
        ticks = _nice_ticks(vmax)
    label_width = max(label_width, _text_width(categories) + 20)
    width = max(width, label_width + 420)
    plot_x0, plot_x1 = label_width, width - 70

    def xpos(v: float) -> float:
        if log:
            v = max(v, ticks[0])
            return plot_x0 + (math.log10(v) - lo) / (hi - lo) * (plot_x1 - plot_x0)
        return plot_x0 + v / ticks[-1] * (plot_x1 - plot_x0)

    out: list[str] = [_text(10, 22, title, size=15, weight="bold")]
    legend, y_leg = _legend(series, colors, 10, 44, width - 10)
    out += legend
    y = y_leg + 18
    top = y
    body: list[str] = []
    for cat in categories:
        drawn = [s for s in series if (cat, s) in values]
        if not drawn:
            continue
        gh = len(drawn) * (bar_h + gap) - gap
        body.append(_text(plot_x0 - 8, y + gh / 2 + 4, cat, size=12, anchor="end"))
        for s in drawn:
            color = colors[series.index(s) % len(colors)]
            v = values[(cat, s)]
            if v is None:
                body.append(_text(plot_x0 + 4, y + bar_h - 3, labels.get((cat, s), missing_label),
                                  size=11, color="#b00"))
            else:
                x1 = xpos(v) if v > 0 else plot_x0
                body.append(f'<rect x="{plot_x0}" y="{y:.1f}" width="{max(0.5, x1 - plot_x0):.1f}" '
                            f'height="{bar_h}" fill="{color}"><title>{_esc(s)}: {_esc(_fmt(v))}'
                            f'{_esc(" " + unit if unit else "")}</title></rect>')
                body.append(_text(x1 + 4, y + bar_h - 3, labels.get((cat, s), _fmt(v)), size=11))
            y += bar_h + gap
        y += group_gap - gap
    bottom = y
    axis = [f'<line x1="{plot_x0}" y1="{top - 4}" x2="{plot_x0}" y2="{bottom}" stroke="#444"/>']
    for t in ticks:
        x = xpos(t) if (t > 0 or not log) else plot_x0
        axis.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{bottom}" '
                    f'stroke="#ddd"/>')
        axis.append(_text(x, bottom + 14, _fmt(t), size=11, anchor="middle", color="#555"))
    if reference:
        rx = xpos(reference[0])
        axis.append(f'<line x1="{rx:.1f}" y1="{top - 8}" x2="{rx:.1f}" y2="{bottom}" '
                    f'stroke="#b00" stroke-dasharray="4,3"/>')
        axis.append(_text(rx + 3, top - 8, reference[1], size=11, color="#b00"))
    axis.append(_text((plot_x0 + plot_x1) / 2, bottom + 30,
                      (unit + (" (log scale)" if log else "")).strip(), size=12,
                      anchor="middle", color="#333"))
    height = bottom + 42
    return _doc(width, height, out + axis + body)


def stacked_bars(title: str, rows: Sequence[str], parts: Sequence[str],
                 values: Mapping[str, Sequence[float]], *, unit: str = "",
                 right_labels: Mapping[str, str] | None = None, width: int = 760,
                 label_width: int = 250, colors: Sequence[str] | None = None) -> str:
    """One horizontal bar per row, split into ``parts`` (``values[row]`` in that order)."""
    colors = list(colors or PALETTE)
    right_labels = right_labels or {}
    bar_h, gap = 16, 6
    label_width = max(label_width, _text_width(rows) + 20)
    width = max(width, label_width + 420)
    totals = [sum(max(0.0, v) for v in values.get(r, ())) for r in rows]
    ticks = _nice_ticks(max(totals, default=1.0) or 1.0)
    plot_x0, plot_x1 = label_width, width - 80
    scale = (plot_x1 - plot_x0) / ticks[-1]
    out = [_text(10, 22, title, size=15, weight="bold")]
    legend, y_leg = _legend(parts, colors, 10, 44, width - 10)
    out += legend
    y = top = y_leg + 18
    body: list[str] = []
    for r in rows:
        body.append(_text(plot_x0 - 8, y + bar_h - 3, r, size=12, anchor="end"))
        x = float(plot_x0)
        for i, v in enumerate(values.get(r, ())):
            w = max(0.0, v) * scale
            if w > 0:
                body.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{bar_h}" '
                            f'fill="{colors[i % len(colors)]}"><title>{_esc(parts[i])}: '
                            f'{_esc(_fmt(v))}{_esc(" " + unit if unit else "")}</title></rect>')
            x += w
        if r in right_labels:
            body.append(_text(x + 4, y + bar_h - 3, right_labels[r], size=11))
        y += bar_h + gap
    bottom = y
    axis = [f'<line x1="{plot_x0}" y1="{top - 4}" x2="{plot_x0}" y2="{bottom}" stroke="#444"/>']
    for t in ticks:
        x = plot_x0 + t * scale
        axis.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{bottom}" '
                    f'stroke="#ddd"/>')
        axis.append(_text(x, bottom + 14, _fmt(t), size=11, anchor="middle", color="#555"))
    axis.append(_text((plot_x0 + plot_x1) / 2, bottom + 30, unit, size=12, anchor="middle",
                      color="#333"))
    return _doc(width, bottom + 42, out + axis + body)


def _doc(width: int, height: float, items: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height:.0f}" '
            f'viewBox="0 0 {width} {height:.0f}">\n'
            f'<rect x="0" y="0" width="{width}" height="{height:.0f}" fill="white"/>\n'
            + "\n".join(items) + "\n</svg>\n")
