"""The page's HTML: plain markup and one inline SVG chart, no scripts (it must render in any
browser, headless Chromium included, with nothing to fetch but the page itself)."""
from __future__ import annotations

import time
from html import escape

from tide.services.page_data import Panel

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
MARK_COLORS = {"swap": "#ff7f0e", "shift": "#555", "detected": "#9467bd"}
CHART_W_PX, CHART_H_PX, PAD_PX = 760, 260, 40

STYLE = """body{font-family:sans-serif;margin:1.5em;max-width:60em}
section{border:1px solid #ccc;border-radius:6px;padding:.5em 1em;margin:1em 0}
h2{font-size:1.05em;margin:.3em 0}.reason{color:#a33}table{border-collapse:collapse}
td,th{padding:2px 10px;text-align:left;border-bottom:1px solid #eee}.legend span{margin-right:1em}"""


def render(panels: list[Panel], refresh_s: int, window_s: float) -> str:
    body = "\n".join(_panel(p) for p in panels)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return (f'<!doctype html><html><head><meta charset="utf-8">'
            f'<meta http-equiv="refresh" content="{refresh_s}"><title>TIDE: the loop</title>'
            f"<style>{STYLE}</style></head><body><h1>TIDE: the loop</h1>"
            f"<p>{stamp}; last {window_s / 60:.0f} min; refreshes every {refresh_s} s "
            f"(<code>?minutes=N</code> widens the chart)</p>\n{body}</body></html>")


def _panel(p: Panel) -> str:
    parts = [f"<h2>{escape(p.title)}</h2>"]
    if p.reason:
        parts.append(f'<p class="reason">{escape(p.reason)}</p>')
    if p.series:
        parts.append(_chart(p))
    if p.rows:
        parts.append("<table>" + "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>"
                                         for k, v in p.rows) + "</table>")
    if p.table:
        parts.append(_table(p.table))
    has = "true" if p.has_data else "false"
    return f'<section data-panel="{p.name}" data-has-data="{has}">{"".join(parts)}</section>'


def _table(rows: list[dict]) -> str:
    head = "".join(f"<th>{escape(str(k))}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{escape(str(v))}</td>" for v in r.values()) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _chart(p: Panel) -> str:
    """Lines of acceptance by version over time; vertical lines at swaps and the shift."""
    points = [pt for pts in p.series.values() for pt in pts]
    t0 = min([t for t, _ in points] + [m[0] for m in p.marks])
    t1 = max([t for t, _ in points] + [m[0] for m in p.marks])
    lo, hi = min(1.0, min(v for _, v in points)), max(v for _, v in points) * 1.05
    span_s, span_v = max(t1 - t0, 1.0), max(hi - lo, 1e-6)

    def x(t: float) -> float:
        return PAD_PX + (t - t0) / span_s * (CHART_W_PX - 2 * PAD_PX)

    def y(v: float) -> float:
        return CHART_H_PX - PAD_PX - (v - lo) / span_v * (CHART_H_PX - 2 * PAD_PX)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{CHART_W_PX}" height="{CHART_H_PX}">',
           _axes(lo, hi, t0, t1, y)]
    legend = []
    for i, (version, pts) in enumerate(sorted(p.series.items())):
        color = COLORS[i % len(COLORS)]
        path = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in pts)
        out.append(f'<polyline data-version="{escape(version)}" fill="none" stroke="{color}" '
                   f'stroke-width="2" points="{path}"/>')
        legend.append(f'<span style="color:{color}">&#9632; drafter v{escape(version)}</span>')
    for t, kind, label in p.marks:
        color = MARK_COLORS.get(kind, "#999")
        out.append(f'<g data-mark="{escape(kind)}"><line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{PAD_PX / 2}" '
                   f'y2="{CHART_H_PX - PAD_PX}" stroke="{color}" stroke-dasharray="4 3"/>'
                   f'<text x="{x(t) + 3:.1f}" y="{PAD_PX / 2 + 10}" font-size="11" fill="{color}">'
                   f"{escape(label)}</text></g>")
    out.append("</svg>")
    return "".join(out) + f'<div class="legend">{"".join(legend)}</div>'


def _axes(lo: float, hi: float, t0: float, t1: float, y) -> str:
    bottom, right = CHART_H_PX - PAD_PX, CHART_W_PX - PAD_PX
    clock = [time.strftime("%H:%M:%S", time.localtime(t)) for t in (t0, t1)]
    return (f'<line x1="{PAD_PX}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#888"/>'
            f'<line x1="{PAD_PX}" y1="{PAD_PX / 2}" x2="{PAD_PX}" y2="{bottom}" stroke="#888"/>'
            f'<text x="2" y="{y(hi):.0f}" font-size="11">{hi:.2f}</text>'
            f'<text x="2" y="{y(lo):.0f}" font-size="11">{lo:.2f}</text>'
            f'<text x="{PAD_PX}" y="{bottom + 15}" font-size="11">{clock[0]}</text>'
            f'<text x="{right - 50}" y="{bottom + 15}" font-size="11">{clock[1]}</text>')
