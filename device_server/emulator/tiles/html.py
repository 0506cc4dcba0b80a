"""A self-contained HTML page (inline SVG, no scripts, no external assets) for one estimate.

    render_html(report_dict) -> str        report_dict: Estimate.to_dict() (or its JSON parsed)
    save_html(report_dict, path) -> path

Sections: summary (preset, latency, throughput, cycles by phase, memory), memory per tile
across the chip by category (stacked, every tile), the fullest tile's largest contributors,
its liveness over the program's steps (``report["liveness"]``: bytes per step against the
SRAM and the margin, the peak marked, the tensors live there),
top operations by cycles (with their Keras layer), cycles by layer, the BSP timeline
(compute / sync / exchange of each superstep, loops marked; IPU-Links for the all-reduces
and replica syncs of a replicated program), the replicas with their ring and host link, the
batch-size sweep when the report carries one (``report["sweep"]``), the largest micro-batch
per option (``report["max_batch"]``, from ``tf_ipu.max_batch_size``), and the assumptions
and preset figures behind it all. The verdict says whether the fullest tile fits, is over
within the tile model's margin, is refused, or is unknown (the tile model failed).
The page is well-formed XML, so tests can parse it with ``xml.etree``.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["render_html", "save_html"]

_COLORS = {
    "variables": "#4e79a7", "inputs": "#76b7b2", "constants": "#9c755f",
    "code and vertex state": "#b07aa1", "exchange code": "#ff9da7", "activations": "#f28e2b",
    "temporaries": "#e15759", "compute": "#59a14f", "exchange": "#e15759", "sync": "#bab0ac",
    "IPU-Links": "#edc948", "latency": "#4e79a7", "throughput": "#f28e2b", "cycles": "#4e79a7",
}
_W = 960  # chart width in px


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _fmt_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"


def _fmt_s(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{_e(cls)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _legend(names: Sequence[str]) -> str:
    items = "".join(
        f'<span class="key"><span class="swatch" style="background:{_COLORS.get(n, "#999")}"></span>{_e(n)}</span>'
        for n in names
    )
    return f'<div class="legend">{items}</div>'


# ------------------------------------------------------------------------------ charts


def _memory_chart(report: dict[str, Any]) -> str:
    mem: dict[str, list[int]] = report.get("memory") or {}
    cats = [c for c in mem if any(mem[c])]
    tiles = len(next(iter(mem.values()))) if mem else 0
    if not tiles:
        return "<p>No per-tile memory in this report.</p>"
    limit = float(report.get("tile_bytes_limit") or 0)
    totals = [sum(mem[c][t] for c in cats) for t in range(tiles)]
    top = max(max(totals), limit) * 1.08 or 1.0
    h, left, bottom = 260, 60, 24
    pw, ph = _W - left - 10, h - bottom - 10
    x = [left + pw * (t + 0.5) / tiles for t in range(tiles)]

    def y(v: float) -> float:
        return 10 + ph * (1 - v / top)

    paths = []
    base = [0.0] * tiles
    for c in cats:
        upper = [base[t] + mem[c][t] for t in range(tiles)]
        pts = [f"{x[t]:.1f},{y(upper[t]):.1f}" for t in range(tiles)]
        pts += [f"{x[t]:.1f},{y(base[t]):.1f}" for t in reversed(range(tiles))]
        paths.append(f'<polygon fill="{_COLORS.get(c, "#999")}" points="{" ".join(pts)}"><title>{_e(c)}</title></polygon>')
        base = upper
    ticks = []
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        v = top * frac
        ticks.append(f'<text x="{left - 4}" y="{y(v) + 4:.1f}" class="ax" text-anchor="end">{_e(_fmt_bytes(v))}</text>')
    for t in (0, tiles // 4, tiles // 2, 3 * tiles // 4, tiles - 1):
        ticks.append(f'<text x="{x[t]:.1f}" y="{h - 6}" class="ax" text-anchor="middle">{t}</text>')
    lim = ""
    if limit:
        lim = (f'<line x1="{left}" x2="{left + pw}" y1="{y(limit):.1f}" y2="{y(limit):.1f}" '
               f'stroke="#000" stroke-dasharray="6 3"/>'
               f'<text x="{left + pw - 4}" y="{y(limit) - 4:.1f}" class="ax" text-anchor="end">'
               f'SRAM per tile {_e(_fmt_bytes(limit))}</text>')
    peak = int(report.get("peak_tile", 0))
    mark = ""
    if 0 <= peak < tiles:
        right = x[peak] > left + 0.8 * pw
        tx, anchor = (x[peak] - 3, "end") if right else (x[peak] + 3, "start")
        mark = (f'<line x1="{x[peak]:.1f}" x2="{x[peak]:.1f}" y1="10" y2="{10 + ph}" stroke="#d00" '
                f'stroke-width="1"/><text x="{tx:.1f}" y="{10 + ph - 6}" class="ax" fill="#d00" '
                f'text-anchor="{anchor}">peak: tile {peak}</text>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{h}" role="img">'
           f'<rect x="{left}" y="10" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>'
           + "".join(paths) + lim + mark + "".join(ticks) + "</svg>")
    return svg + _legend(cats)


def _bars(rows: list[tuple[str, dict[str, float], str]], phases: Sequence[str]) -> str:
    """Horizontal stacked bars: (label, {phase: value}, tooltip)."""
    if not rows:
        return "<p>None.</p>"
    bar_h, gap, label_w = 16, 4, 330
    h = len(rows) * (bar_h + gap) + 10
    top = max(sum(v.values()) for _, v, _ in rows) or 1.0
    pw = _W - label_w - 90
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{h}" role="img">']
    for n, (label, vals, tip) in enumerate(rows):
        yy = 5 + n * (bar_h + gap)
        out.append(f'<text x="{label_w - 6}" y="{yy + 12}" class="lbl" text-anchor="end">{_e(label[:52])}</text>')
        xx = float(label_w)
        for p in phases:
            w = pw * vals.get(p, 0.0) / top
            if w > 0:
                out.append(f'<rect x="{xx:.1f}" y="{yy}" width="{w:.1f}" height="{bar_h}" '
                           f'fill="{_COLORS[p]}"><title>{_e(tip)}; {_e(p)} {vals.get(p, 0.0):,.0f} cycles</title></rect>')
                xx += w
        out.append(f'<text x="{xx + 4:.1f}" y="{yy + 12}" class="ax">{sum(vals.values()):,.0f}</text>')
    out.append("</svg>")
    return "".join(out) + _legend(phases)


def _timeline(report: dict[str, Any]) -> str:
    entries = [e for e in report.get("timeline") or [] if e.get("kind") != "loop"]
    loops = [e for e in report.get("timeline") or [] if e.get("kind") == "loop"]
    if not entries:
        return "<p>No supersteps.</p>"
    def own(e: dict[str, Any]) -> float:
        return e["compute"] + e["exchange"] + e["sync"] + e.get("link", 0.0)

    total = sum(own(e) * e.get("repeat", 1) for e in entries) or 1.0
    phases = ["compute", "sync", "exchange"]
    if any(e.get("link") for e in entries):
        phases.append("IPU-Links")
    left, lane = 70, 22
    h = 44 + lane * len(phases)
    pw = _W - left - 10
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{h}" role="img">']
    for n, p in enumerate(phases):
        out.append(f'<text x="{left - 6}" y="{14 + n * lane + 12}" class="lbl" text-anchor="end">{p}</text>')
        out.append(f'<rect x="{left}" y="{14 + n * lane}" width="{pw}" height="{lane - 4}" fill="#f4f4f4"/>')
    lanes = {p: n for n, p in enumerate(phases)}
    t = 0.0
    for e in entries:
        reps = e.get("repeat", 1)
        x = left + pw * t / total
        # a superstep: exchange, sync, compute; then what crosses the IPU-Links
        for p, key in (("exchange", "exchange"), ("sync", "sync"), ("compute", "compute"),
                       ("IPU-Links", "link")):
            w = pw * e.get(key, 0.0) * reps / total
            if w >= (0.005 if p == "sync" else 0.05) and p in lanes:
                tip = f"{e['name']} ({e.get('layer') or e.get('opcode', '')}) {p} {e[key]:,.0f} x{reps}"
                out.append(f'<rect x="{x:.2f}" y="{14 + lanes[p] * lane}" width="{max(w, 0.3):.2f}" '
                           f'height="{lane - 4}" fill="{_COLORS[p]}"><title>{_e(tip)}</title></rect>')
            x += w
        t += own(e) * reps
    for n in range(5):
        frac = n / 4
        anchor = "start" if n == 0 else "end" if n == 4 else "middle"
        out.append(f'<text x="{left + pw * frac:.1f}" y="{h - 8}" class="ax" text-anchor="{anchor}">'
                   f'{total * frac:,.0f}</text>')
    out.append("</svg>")
    note = ""
    if loops:
        note = "<p>Loops: " + "; ".join(f"'{_e(lp['name'])}' x{lp.get('trips', 1)}" for lp in loops[:8]) \
            + " (their supersteps are drawn once, widened by the trip count).</p>"
    return "".join(out) + note + ("<p>x: device cycles from the start of the call (host transfers "
                                  "not drawn); syncs are drawn at least 0.3 px wide.</p>")


def _ipu_memory(report: dict[str, Any]) -> str:
    """A pipelined program's IPUs: each one's fullest tile by category against the SRAM."""
    ipus = report.get("ipus") or []
    if not ipus:
        return ""
    limit = float(report.get("tile_bytes_limit") or 0)
    cats = [c for c in _COLORS if any((d.get("at_peak_tile") or {}).get(c) for d in ipus)]
    bar_h, gap, label_w = 18, 6, 250
    h = len(ipus) * (bar_h + gap) + 24
    top = max(max(d["peak_tile_bytes"] for d in ipus), limit) * 1.08 or 1.0
    pw = _W - label_w - 110
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{h}" role="img">']
    for n, d in enumerate(ipus):
        yy = 5 + n * (bar_h + gap)
        label = (f"IPU {d['ipu']} (id {d.get('ipu_id', d['ipu'])}), stage"
                 f"{'s' if len(d['stages']) != 1 else ''} {', '.join(map(str, d['stages']))}")
        out.append(f'<text x="{label_w - 6}" y="{yy + 13}" class="lbl" text-anchor="end">{_e(label)}</text>')
        xx = float(label_w)
        for c in cats:
            v = float((d.get("at_peak_tile") or {}).get(c, 0))
            w = pw * v / top
            if w > 0:
                out.append(f'<rect x="{xx:.1f}" y="{yy}" width="{w:.1f}" height="{bar_h}" '
                           f'fill="{_COLORS[c]}"><title>{_e(c)}: {v:,.0f} B on tile '
                           f'{d["peak_tile"]}</title></rect>')
                xx += w
        verdict = "" if d.get("fits", True) else " OVER"
        out.append(f'<text x="{xx + 4:.1f}" y="{yy + 13}" class="ax">{_e(_fmt_bytes(d["peak_tile_bytes"]))}'
                   f'{verdict}</text>')
    if limit:
        x = label_w + pw * limit / top
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="2" y2="{h - 18}" stroke="#000" '
                   f'stroke-dasharray="6 3"/><text x="{x:.1f}" y="{h - 6}" class="ax" '
                   f'text-anchor="middle">SRAM per tile {_e(_fmt_bytes(limit))}</text>')
    out.append("</svg>")
    rows = [(d["ipu"], d.get("ipu_id", d["ipu"]), ", ".join(map(str, d["stages"])), d["peak_tile"],
             f"{d['peak_tile_bytes']:,}", f"{d.get('stash_bytes', 0):,}", f"{d['always_live_bytes']:,}",
             f"{d.get('total_bytes', 0):,}", "yes" if d.get("fits", True) else "NO") for d in ipus]
    return ("<p>The fullest tile of each IPU of a replica, by category (activations include the "
            "micro-batches stashed for the backward pass).</p>" + "".join(out) + _legend(cats)
            + _table(["IPU", "IPU id", "stages", "peak tile", "peak tile bytes",
                      "stashed (all tiles)", "always live", "total", "fits"], rows))


def _pipeline(report: dict[str, Any]) -> str:
    """The stages' figures and the pipeline's timeline (stages x slots, micro-batches)."""
    stages = report.get("stages") or []
    slots = report.get("pipeline_timeline") or []
    if not stages:
        return ""
    rows = [(d["stage"], d["ipu"], f"{d['forward_cycles']:,.0f}", f"{d['backward_cycles']:,.0f}",
             f"{d['recompute_cycles']:,.0f}", f"{d['update_cycles']:,.0f}", d["in_flight"],
             f"{d['stash_bytes']:,}", f"{d['checkpoint_bytes']:,}", f"{d['sends_forward_bytes']:,}",
             f"{d['sends_backward_bytes']:,}", ", ".join(d.get("layers", [])[:6])
             + (" ..." if len(d.get("layers", [])) > 6 else "")) for d in stages]
    table = _table(["stage", "IPU", "forward", "backward", "recompute", "update",
                    "in flight", "stash B", "checkpoint B", "sends fwd B", "sends bwd B",
                    "Keras layers"], rows)
    if not slots:
        return table
    S = len(stages)
    total = sum(float(sl["cycles"]) for sl in slots) or 1.0
    left, lane = 70, 22
    h = 34 + lane * S
    pw = _W - left - 10
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{h}" role="img">']
    for s in range(S):
        out.append(f'<text x="{left - 6}" y="{8 + s * lane + 13}" class="lbl" text-anchor="end">'
                   f'stage {s}</text>')
        out.append(f'<rect x="{left}" y="{8 + s * lane}" width="{pw}" height="{lane - 4}" fill="#f4f4f4"/>')
    t = 0.0
    for sl in slots:
        start = left + pw * t / total
        ipu_at: dict[int, float] = {}   # passes on one IPU run one after the other
        for s, i, kind in sl["passes"]:
            d = stages[s]
            own = d["forward_cycles"] if kind == "F" else d["backward_cycles"] + d["recompute_cycles"]
            w = max(0.5, pw * float(own) / total)
            x0 = ipu_at.get(d["ipu"], start)
            ipu_at[d["ipu"]] = x0 + w
            color = _COLORS["compute"] if kind == "F" else _COLORS["exchange"]
            out.append(f'<rect x="{x0:.2f}" y="{8 + s * lane}" width="{w:.2f}" height="{lane - 4}" '
                       f'fill="{color}" stroke="#fff" stroke-width="0.5"><title>slot {sl["slot"]}: '
                       f'{"forward" if kind == "F" else "backward"} of micro-batch {i} on stage {s}, '
                       f'{own:,.0f} cycles</title></rect>')
            if w > 14:
                out.append(f'<text x="{x0 + w / 2:.1f}" y="{8 + s * lane + 13}" class="ax" '
                           f'text-anchor="middle">{kind}{i}</text>')
        t += float(sl["cycles"])
    for n in range(5):
        frac = n / 4
        anchor = "start" if n == 0 else "end" if n == 4 else "middle"
        out.append(f'<text x="{left + pw * frac:.1f}" y="{h - 6}" class="ax" text-anchor="{anchor}">'
                   f'{total * frac:,.0f}</text>')
    out.append("</svg>")
    return (table + "".join(out)
            + f"<p>One weight update: {len(slots)} slots drawn, {total:,.0f} cycles (F: forward, "
            "B: backward of micro-batch i; a slot lasts its busiest IPU plus its inter-IPU sends "
            "and a sync; the weight update follows the last slot).</p>")


_PHASES = {"F": ("forward", "#4e79a7"), "B": ("backward", "#f28e2b"), "U": ("weight update", "#59a14f"),
           "": ("not-always-live", "#76b7b2")}
_STAGE_COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#9c755f")
_HOVER_COLUMNS = 320  # at most this many hover boxes over the liveness chart


def _liveness_chart(report: dict[str, Any]) -> str:
    """The liveness view: the fullest tile's bytes over the program's steps (an area, by
    phase, over the always-live bytes and a pipeline's stash), the tile's SRAM and the
    margin, the peak marked; then the tensors live at the peak and the steps around it."""
    lv: dict[str, Any] = report.get("liveness") or {}
    pts: list[list[Any]] = lv.get("points") or []
    if not pts:
        return "<p>No liveness trace in this report.</p>"
    n = max(int(lv.get("positions") or 0), int(pts[-1][0]) + 1)
    bucket = max(1, int(lv.get("bucket") or 1))
    limit = float(report.get("tile_bytes_limit") or 0)
    margin = float(report.get("margin_bytes") or 0.05 * limit)
    base = float(lv.get("always_live_bytes", 0)) - float(lv.get("offloaded_bytes", 0))
    extra = float(lv.get("extra_bytes", 0))
    peak = lv.get("peak") or {}
    peak_pos, peak_bytes = int(peak.get("position", -1)), float(peak.get("bytes", 0))
    highest = max(float(p[1]) for p in pts)
    # A tile far below its SRAM is drawn to its own scale (the SRAM line off the chart, said).
    off_scale = bool(limit) and highest < 0.25 * limit
    top = (highest * 1.15 if off_scale else max(highest, limit + margin) * 1.08) or 1.0
    stages = sorted({int(p[5]) for p in pts if int(p[5]) >= 0})
    strip = 10 if len(stages) > 1 else 0
    h, left, right = 300 + strip, 76, 10
    pw, ph, y0 = _W - left - right, 250, 12

    def x(pos: float) -> float:
        return left + pw * min(max(pos, 0.0), n) / n

    def y(v: float) -> float:
        return y0 + ph * (1 - max(v, 0.0) / top)

    def span(j: int) -> tuple[float, float]:  # the steps the j-th kept point stands for
        start = int(pts[j][0]) // bucket * bucket
        return x(start), x(min(n, start + bucket))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{h}" role="img">',
           f'<rect x="{left}" y="{y0}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>']
    if base > 0:
        out.append(f'<rect x="{left}" y="{y(base):.1f}" width="{pw}" height="{y(0) - y(base):.1f}" '
                   f'fill="#bab0ac"><title>always live: {base:,.0f} B</title></rect>')
    if extra > 0:
        out.append(f'<rect x="{left}" y="{y(base + extra):.1f}" width="{pw}" '
                   f'height="{y(base) - y(base + extra):.1f}" fill="#edc948"><title>stashed '
                   f'micro-batches: {extra:,.0f} B at every step</title></rect>')
    floor = y(base + extra)
    runs: list[tuple[str, list[int]]] = []
    for j, p in enumerate(pts):  # consecutive points of one phase make one polygon
        letter = str(p[6]) if str(p[6]) in _PHASES else ""
        if runs and runs[-1][0] == letter:
            runs[-1][1].append(j)
        else:
            runs.append((letter, [j]))
    for letter, idx in runs:
        edge = []
        for j in idx:
            a, b = span(j)
            edge += [f"{a:.2f},{y(float(pts[j][1])):.1f}", f"{b:.2f},{y(float(pts[j][1])):.1f}"]
        a, b = span(idx[0])[0], span(idx[-1])[1]
        name, color = _PHASES[letter]
        out.append(f'<polygon fill="{color}" fill-opacity="0.85" points="{a:.2f},{floor:.1f} '
                   f'{" ".join(edge)} {b:.2f},{floor:.1f}"><title>{_e(name)}</title></polygon>')
    if strip:
        for j, p in enumerate(pts):
            if int(p[5]) < 0:
                continue
            a, b = span(j)
            out.append(f'<rect x="{a:.2f}" y="{y0 + ph + 2}" width="{max(b - a, 0.3):.2f}" '
                       f'height="{strip - 3}" fill="{_STAGE_COLORS[int(p[5]) % len(_STAGE_COLORS)]}"/>')
    backward = (lv.get("phase_starts") or {}).get("B")
    if backward is not None:
        bx = x(float(backward))
        out.append(f'<line x1="{bx:.1f}" x2="{bx:.1f}" y1="{y0}" y2="{y0 + ph}" stroke="#555" '
                   f'stroke-dasharray="3 3"/><text x="{bx + 3:.1f}" y="{y0 + 12}" class="ax">'
                   f'backward from step {int(backward):,}</text>')
    for v, dash, color, label in ((limit, "6 3", "#000", f"SRAM per tile {_fmt_bytes(limit)}"),
                                  (limit + margin, "2 3", "#d00",
                                   f"+ margin {_fmt_bytes(margin)}")):
        if limit and not off_scale:
            out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                       f'stroke="{color}" stroke-dasharray="{dash}"/><text x="{left + pw - 4}" '
                       f'y="{y(v) - 3:.1f}" class="ax" text-anchor="end">{_e(label)}</text>')
    if off_scale:
        out.append(f'<text x="{left + pw - 4}" y="{y0 + 12}" class="ax" text-anchor="end">SRAM per '
                   f'tile {_e(_fmt_bytes(limit))} (+ margin {_e(_fmt_bytes(margin))}) is above this '
                   f'scale: the peak is {highest / limit:.1%} of it</text>')
    # Hover boxes: each the fullest kept point of its column.
    per = max(1, -(-len(pts) // _HOVER_COLUMNS))
    for j0 in range(0, len(pts), per):
        j = max(range(j0, min(len(pts), j0 + per)), key=lambda i: float(pts[i][1]))
        a, b = span(j0)[0], span(min(len(pts), j0 + per) - 1)[1]
        p = pts[j]
        what = ", ".join(str(v) for v in (p[3], p[4]) if v)
        tip = (f"step {int(p[0]):,}: {p[2]}" + (f" ({what})" if what else "")
               + (f", stage {p[5]}" if strip else "")
               + (f", {_PHASES[p[6]][0]}" if p[6] in _PHASES and p[6] else "")
               + f": {float(p[1]):,.0f} B")
        out.append(f'<rect x="{a:.2f}" y="{y0}" width="{max(b - a, 0.3):.2f}" height="{ph}" '
                   f'fill="#000" fill-opacity="0"><title>{_e(tip)}</title></rect>')
    if peak_pos >= 0:
        px, py = x(peak_pos + 0.5), y(peak_bytes)
        right_side = px > left + 0.6 * pw
        tx, anchor = (px - 6, "end") if right_side else (px + 6, "start")
        what = ", ".join(str(v) for v in (peak.get("opcode"), peak.get("layer")) if v)
        label = (f"peak {peak_bytes:,.0f} B at step {peak_pos:,}: {peak.get('name', '')}"
                 + (f" ({what})" if what else ""))
        out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="#d00"><title>{_e(label)}'
                   f'</title></circle><text x="{tx:.1f}" y="{max(py - 6, y0 + 24):.1f}" class="ax" '
                   f'fill="#d00" text-anchor="{anchor}">peak {peak_bytes:,.0f} B, step {peak_pos:,}: '
                   f'{_e(str(peak.get("name", ""))[:48])}</text>')
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        out.append(f'<text x="{left - 4}" y="{y(top * frac) + 4:.1f}" class="ax" text-anchor="end">'
                   f'{_e(_fmt_bytes(top * frac))}</text>')
        anchor = "start" if frac == 0 else "end" if frac == 1 else "middle"
        out.append(f'<text x="{x(n * frac):.1f}" y="{h - 6}" class="ax" text-anchor="{anchor}">'
                   f'{int(round((n - 1) * frac)):,}</text>')
    out.append("</svg>")
    keys = [letter for letter in ("F", "B", "U", "") if any(r[0] == letter for r in runs)]
    legend = "".join(
        f'<span class="key"><span class="swatch" style="background:{c}"></span>{_e(t)}</span>'
        for c, t in ([("#bab0ac", "always live")] if base > 0 else [])
        + ([("#edc948", "stash (constant)")] if extra > 0 else [])
        + [(_PHASES[k][1], _PHASES[k][0]) for k in keys]
        + [(_STAGE_COLORS[st % len(_STAGE_COLORS)], f"stage {st} (strip)") for st in (stages if strip else [])])
    return "".join(out) + f'<div class="legend">{legend}</div>'


def _liveness(report: dict[str, Any]) -> str:
    """The liveness section's text, chart and tables."""
    lv: dict[str, Any] = report.get("liveness") or {}
    if not lv.get("points"):
        return ("<p>No liveness trace in this report (made by the tile model's estimate of a "
                "program; not for one whose fit is unknown).</p>")
    n = int(lv.get("positions") or 0)
    bucket = int(lv.get("bucket") or 1)
    order = {"scheduled": "the memory-aware schedule", "hlo": "HLO order"}.get(
        str(lv.get("order")), str(lv.get("order")))
    cats = lv.get("always_live") or {}
    always = ", ".join(f"{c} {int(b):,} B" for c, b in cats.items())
    peak = lv.get("peak") or {}
    text = (f"<p>Bytes on tile {_e(lv.get('tile'))}"
            + (f" of IPU {_e(lv.get('ipu'))}" if int(report.get("pipeline_stages") or 1) > 1 else "")
            + f" at each of the program's {n:,} steps (the entry computation's instructions in "
            f"{_e(order)}, the order the estimate counted, then its end), as PopVision's liveness "
            "report shows them: the always-live bytes (grey: "
            f"{_e(always) or 'none'}) plus the tensors live at the step, its temporaries and the "
            "peak of a loop or call it runs, coloured by phase. Its highest point is the tile's "
            f"peak, {int(peak.get('bytes', 0)):,} B, at step {int(peak.get('position', 0)):,}."
            + (f" Down-sampled: each point is the fullest of {bucket} consecutive steps." if bucket > 1
               else "") + "</p>")
    notes = "".join(f"<li>{_e(x)}</li>" for x in lv.get("notes") or [])
    top = lv.get("top") or []
    rows = [(c["name"], c.get("opcode", ""), c.get("layer", ""), c["kind"], f"{int(c['bytes']):,}",
             c.get("where", "")) for c in top[:20]]
    pts = lv.get("points") or []
    at = next((j for j, p in enumerate(pts) if int(p[0]) == int(peak.get("position", -1))), None)
    around = []
    if at is not None:
        for p in pts[max(0, at - 4):at + 5]:
            around.append((f"{int(p[0]):,}" + (" (peak)" if p is pts[at] else ""), p[2], p[3], p[4],
                           p[5] if int(p[5]) >= 0 else "", _PHASES.get(p[6], ("", ""))[0]
                           if p[6] else "", f"{int(p[1]):,}"))
    return (text + (f"<ul>{notes}</ul>" if notes else "") + _liveness_chart(report)
            + f"<p>Live at the peak (step {int(peak.get('position', 0)):,}): "
            f"{int(peak.get('not_always_live_bytes', 0)):,} B of tensors and temporaries, the "
            "largest:</p>"
            + _table(["tensor", "opcode", "Keras layer", "kind", "bytes", "inside"], rows)
            + "<p>Steps around the peak" + (" (kept points)" if bucket > 1 else "") + ":</p>"
            + _table(["step", "instruction", "opcode", "Keras layer", "stage", "phase", "bytes"], around))


def _line_chart(points: list[tuple[float, float, bool]], ylabel: str, color: str, fmt: Any) -> str:
    if not points:
        return ""
    w, h, left, bottom = _W // 2 - 10, 240, 70, 30
    pw, ph = w - left - 10, h - bottom - 20
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    top = max(ys) * 1.1 or 1.0
    lo, hi = min(xs), max(xs)
    import math

    def x(v: float) -> float:
        if hi == lo:
            return left + pw / 2
        return left + pw * (math.log2(v) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))

    def y(v: float) -> float:
        return 20 + ph * (1 - v / top)

    pts = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b, _ in points)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img">',
           f'<rect x="{left}" y="20" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>',
           f'<text x="{left}" y="14" class="lbl">{_e(ylabel)}</text>',
           f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>']
    for a, b, fits in points:
        fill = color if fits else "#fff"
        out.append(f'<circle cx="{x(a):.1f}" cy="{y(b):.1f}" r="4" fill="{fill}" stroke="{color}">'
                   f'<title>batch {a:g}: {_e(fmt(b))}{"" if fits else " (does not fit)"}</title></circle>')
        out.append(f'<text x="{x(a):.1f}" y="{h - 12}" class="ax" text-anchor="middle">{a:g}</text>')
    for frac in (0.0, 0.5, 1.0):
        out.append(f'<text x="{left - 4}" y="{y(top * frac) + 4:.1f}" class="ax" text-anchor="end">'
                   f'{_e(fmt(top * frac))}</text>')
    out.append(f'<text x="{left + pw / 2:.1f}" y="{h - 0}" class="ax" text-anchor="middle">batch size</text>')
    out.append("</svg>")
    return "".join(out)


def _sweep(report: dict[str, Any]) -> str:
    sweep = report.get("sweep") or []
    if not sweep:
        return ("<p>No batch-size sweep in this report (make one with "
                "<code>tf_ipu.estimate_sweep(model, batch_sizes)</code>).</p>")
    pts = sorted(sweep, key=lambda s: s["batch_size"])
    lat = _line_chart([(p["batch_size"], p["latency_s"], p["fits"]) for p in pts],
                      "latency per step", _COLORS["latency"], _fmt_s)
    thr = _line_chart([(p["batch_size"], p["throughput"], p["fits"]) for p in pts],
                      "throughput (items/s)", _COLORS["throughput"], lambda v: f"{v:,.0f}/s")
    rows = [(p["batch_size"], _fmt_s(p["latency_s"]), f"{p['throughput']:,.1f}",
             f"{p['peak_tile_bytes']:,}", "yes" if p["fits"] else "NO") for p in pts]
    replicas = max(int(p.get("replicas", 1)) for p in pts)
    per = (f"<p>Batch sizes per replica; throughput counts the items of all {replicas} "
           "replicas.</p>") if replicas > 1 else ""
    return (f'<div class="row">{lat}{thr}</div>'
            "<p>Hollow points do not fit the tile memory.</p>" + per
            + _table(["batch size", "latency", "items/s", "peak tile bytes", "fits"], rows))


def _max_batch(report: dict[str, Any]) -> str:
    """``tf_ipu.max_batch_size``'s table: the largest micro-batch that fits (peak <= SRAM) for
    each availableMemoryProportion (rows) with recomputation off and on (columns)."""
    mb = report.get("max_batch") or {}
    table = mb.get("table") or []
    if not mb:
        return ("<p>Not computed for this report (<code>tf_ipu.max_batch_size(model, ...)"
                "</code> makes it; <code>python -m tf_ipu.estimate --max-batch-size</code>).</p>")
    limit = int(mb.get("limit") or 0)

    def cell(c: dict[str, Any] | None) -> str:
        if c is None:
            return ""
        n = int(c["batch_size"])
        return f">= {n:,} (the cap)" if c.get("capped") else f"{n:,}"

    amps = sorted({float(c["available_memory_proportion"]) for c in table})
    by = {(float(c["available_memory_proportion"]), bool(c["recomputation"])): c for c in table}
    rows = [(f"{a:g}", cell(by.get((a, False))), cell(by.get((a, True)))) for a in amps]
    answer = int(mb.get("batch_size", 0))
    head = (f"<p>Largest micro-batch that fits (fullest tile at most its SRAM; 0: not even 1): "
            f"<b>{answer:,}</b>{' (the search cap)' if mb.get('capped') else ''} with the "
            f"options given ({_e(mb.get('options_text', ''))}). Powers of two up to the cap of "
            f"{limit:,}, then bisection between the last that fits and the first that does not; "
            f"{int(mb.get('estimates', 0)):,} estimates ({int(mb.get('plans', 0)):,} planned) in "
            f"{float(mb.get('seconds', 0)):.1f} s.</p>")
    return head + _table(["availableMemoryProportion", "recomputation off", "recomputation on"], rows)


# ------------------------------------------------------------------------------ page


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;max-width:1000px}
h1{font-size:22px;margin-bottom:4px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:12px;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 6px;text-align:left}
th{background:#f0f0f0}.kv td:first-child{font-weight:600}
.legend{font-size:12px;margin:4px 0 8px}.key{margin-right:14px}.swatch{display:inline-block;width:10px;height:10px;margin-right:4px}
.ax{font-size:10px;fill:#555}.lbl{font-size:11px;fill:#222}.bad{color:#c00;font-weight:700}.ok{color:#080;font-weight:700}
.row{display:flex;gap:10px}code{background:#f4f4f4;padding:0 3px}
"""


def _schedule_note(r: dict[str, Any]) -> str:
    """The order memory was counted in, with HLO order's peak beside it."""
    order = r.get("memory_order") or ""
    if not order:
        return ""
    hlo = int(r.get("hlo_order_peak_tile_bytes", 0))
    if order == "hlo":
        return f" (HLO order, no worse than the memory-aware schedule; {hlo:,} B)"
    return (f" in the memory-aware schedule; in HLO order tile {r.get('hlo_order_peak_tile')}: "
            f"{hlo:,} B")


def render_html(report: dict[str, Any]) -> str:
    """The HTML page for a report dict (``Estimate.to_dict()``)."""
    r = report
    ctx = r.get("context") or {}
    title = ctx.get("model") or r.get("program") or "program"
    fits = r.get("fits")
    clock = float(r.get("clock_hz") or 1.0)
    seconds = float(r.get("seconds") or 0.0)
    items = int(r.get("items_per_call") or 0)
    thr = r.get("throughput") or ((items or 1) / seconds if seconds else 0.0)
    summary = [
        ("target", f"{r.get('target', '')}, {r.get('tiles_per_ipu')} tiles at {clock / 1e9:.3g} GHz"),
        ("program", r.get("program", "")),
    ]
    for k in ("model", "batch_size", "global_batch", "training", "inputs"):
        if k in ctx:
            summary.append((k.replace("_", " "), ctx[k]))
    if ctx.get("available_memory_proportion"):
        summary.append(("availableMemoryProportion", ", ".join(
            f"{op} {v:g}" for op, v in ctx["available_memory_proportion"].items())))
    if ctx.get("stage_available_memory_proportion"):  # PipelineStageOptions, per stage
        summary.append(("availableMemoryProportion per stage", "; ".join(
            f"{what} " + " ".join("-" if v is None else f"{v:g}" for v in values)
            for what, values in ctx["stage_available_memory_proportion"].items())))
    if ctx.get("half_partials"):
        summary.append(("partialsType half", ", ".join(ctx["half_partials"])))
    summary += [
        ("latency per call", _fmt_s(seconds)),
        ("throughput", f"{thr:,.1f} {'items' if items else 'calls'}/s"),
        ("cycles", f"{int(r.get('cycles', 0)):,} = device {int(r.get('device_cycles', 0)):,} "
                   f"(compute {int(r.get('compute_cycles', 0)):,}, exchange "
                   f"{int(r.get('exchange_cycles', 0)):,}, sync {int(r.get('sync_cycles', 0)):,}) "
                   + (f"+ all-reduce {int(r.get('all_reduce_cycles', 0)):,} + replica syncs "
                      f"{int(r.get('replica_sync_cycles', 0)):,} "
                      if int(r.get("replicas") or 1) > 1 else "")
                   + f"+ host transfers {int(r.get('host_cycles', 0)):,}"),
        ("host transfers", f"{_fmt_bytes(r.get('host_bytes_in', 0))} in, "
                           f"{_fmt_bytes(r.get('host_bytes_out', 0))} out"
                           + (" per replica" if int(r.get("replicas") or 1) > 1 else "")),
        ("supersteps", f"{int(r.get('supersteps', 0)):,}"),
        ("arithmetic", f"{float(r.get('flops', 0)) / 1e9:,.3f} GFLOP"),
        ("peak tile memory", f"tile {r.get('peak_tile')}: {int(r.get('peak_tile_bytes', 0)):,} B of "
                             f"{int(r.get('tile_bytes_limit', 0)):,} B"
                             + _schedule_note(r)),
        ("total memory", f"{_fmt_bytes(r.get('total_bytes', 0))} "
                         f"({_fmt_bytes(r.get('always_live_bytes', 0))} always live)"),
    ]
    if int(r.get("pipeline_stages") or 1) > 1:
        ipus = r.get("ipus") or []
        summary[2:2] = [
            ("pipeline", f"{r.get('pipeline_stages')} stages, {r.get('pipeline_schedule')} "
                         f"schedule, stage IPUs {r.get('stage_ipus')} of {r.get('ipus_per_replica')} "
                         f"per replica, {r.get('micro_batches')} micro-batch(es) per weight update, "
                         f"{float(r.get('weight_updates_per_call') or 0):g} update(s) per call, "
                         f"{int(r.get('pipeline_cycles_per_update') or 0):,} cycles per update"
                         + (", recomputation" if r.get("recomputation") else "")),
            ("memory per IPU", "; ".join(f"IPU {d['ipu']}: {d['peak_tile_bytes']:,} B on tile "
                                         f"{d['peak_tile']}" for d in ipus)),
        ]
    replicas = int(r.get("replicas") or 1)
    if replicas > 1:
        cycles = float(r.get("cycles") or 0) or 1.0
        ring = r.get("ring") or {}
        link = r.get("host_link") or {}
        summary[2:2] = [
            ("replicas", f"{replicas} on {r.get('system', '')} IPUs "
                         f"{', '.join(map(str, r.get('ipu_ids') or []))}; memory and time are per "
                         "IPU (each replica runs this program)"),
            ("all-reduce", f"{int(r.get('all_reduces', 0)):,} per call, "
                           f"{_fmt_bytes(r.get('all_reduce_bytes', 0))} per replica, "
                           f"{_fmt_s(float(r.get('all_reduce_cycles', 0)) / clock)} = "
                           f"{float(r.get('all_reduce_cycles', 0)) / cycles:.1%} of the call; ring "
                           f"{' > '.join(map(str, ring.get('ipus', [])))} at "
                           f"{float(ring.get('bytes_per_s', 0)) / 1e9:,.1f} GB/s, "
                           f"{float(ring.get('step_latency_s', 0)) * 1e6:.2f} us per step; crosses "
                           f"{' and '.join(ring.get('links', ['IPU-Links']))}"
                           + (f"; then across {len(ring['gw']['pods'])} Pod64s over the GW-Links "
                              f"at {float(ring['gw']['bytes_per_s']) / 1e9:,.1f} GB/s a pod, "
                              f"{_fmt_s(float(r.get('all_reduce_gw_cycles', 0)) / clock)} "
                              f"({float(r.get('all_reduce_gw_cycles', 0)) / cycles:.1%} of the call)"
                              if ring.get("gw") else "")),
            ("replica syncs", f"{int(r.get('replica_syncs', 0)):,} per call, "
                              f"{_fmt_s(float(r.get('replica_sync_cycles', 0)) / clock)}"),
            ("host link", f"{link.get('kind', '')}: {link.get('replicas', 1)} replica(s) on it, "
                          f"{float(link.get('bytes_per_s', 0)) / 1e9:,.1f} GB/s each way"),
        ]
    over = int(r.get("peak_tile_bytes", 0)) - int(r.get("tile_bytes_limit", 0))
    if fits is None:
        verdict = ('<span class="bad">FIT UNKNOWN</span>: the tile model failed, and nothing was '
                   f'counted ({_e(r.get("failure", ""))})')
    elif fits:
        verdict = '<span class="ok">fits</span>'
    elif r.get("within_margin"):
        verdict = ('<span class="bad">DOES NOT FIT</span>, within the tile model\'s margin: tile '
                   f'{_e(r.get("peak_tile"))} is {over:,} B over (the margin allows '
                   f'{int(r.get("margin_bytes", 0)):,} B); it compiles and runs with a warning')
    else:
        verdict = ('<span class="bad">DOES NOT FIT</span> (out of memory on tile '
                   f'{_e(r.get("peak_tile"))})')
    kv = "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in summary)
    contributors = r.get("contributors") or []
    contrib_rows = [(c["name"], c.get("opcode", ""), c.get("layer", ""), c["kind"], f"{c['bytes']:,}",
                     c.get("where", "") + (f" (stage {c['stage']})" if c.get("stage", -1) >= 0 else ""))
                    for c in contributors[:20]]
    layer_rows = [(name, f"{b:,}") for name, b in (r.get("by_layer") or [])[:15]]
    top = r.get("top_ops") or []
    top_rows = [(o["name"] + (f" (+{o['fused'] - 1} fused)" if o.get("fused", 1) > 1 else ""),
                 {"compute": o["compute"], "sync": o["sync"], "exchange": o["exchange"],
                  "IPU-Links": o.get("link", 0.0)},
                 f"{o['opcode']} {o.get('layer', '')}") for o in top[:25]]
    top_phases = ("compute", "sync", "exchange") + \
        (("IPU-Links",) if any(o.get("link") for o in top[:25]) else ())
    top_table = [(o["name"], o["opcode"], o.get("layer", ""), f"{o['cycles']:,.0f}",
                  f"{o['compute']:,.0f}", f"{o['exchange']:,.0f}", f"{o['sync']:,.0f}",
                  o["supersteps"], o["tiles"]) for o in top[:25]]
    layers = r.get("layers") or []
    layer_bars = [(L["layer"], {"cycles": L["cycles"]}, f"{L['supersteps']} supersteps") for L in layers[:20]]
    preset = r.get("preset") or {}
    preset_rows = [(k, v) for k, v in preset.items()]
    notes = "".join(f"<li>{_e(n)}</li>" for n in r.get("notes") or [])
    assumptions = "".join(f"<li>{_e(a)}</li>" for a in r.get("assumptions") or [])
    parts = [
        '<!DOCTYPE html>\n<html xmlns="http://www.w3.org/1999/xhtml" lang="en"><head>',
        '<meta charset="utf-8"/>',
        f"<title>IPU estimate: {_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>IPU estimate: {_e(title)}</h1>",
        f"<p>{verdict}. An estimate from the emulator's tile model "
        "(docs/tile_model.md), not a measurement: the assumptions are listed at the end.</p>",
        "<h2>Summary</h2>", f'<table class="kv"><tbody>{kv}</tbody></table>',
        "<h2>Memory per tile</h2>",
        "<p>Every tile of the chip, each at its own peak, by category (always-live categories "
        "below, not-always-live on top).</p>",
        _memory_chart(r),
    ]
    if int(r.get("pipeline_stages") or 1) > 1:
        parts += [f"<p>(IPU {_e(r.get('peak_ipu'))} of the pipeline, the fullest.)</p>",
                  "<h2>Memory per IPU</h2>", _ipu_memory(r),
                  "<h2>Pipeline: stages and timeline</h2>", _pipeline(r)]
    parts += [
        f"<h2>Largest contributors on tile {_e(r.get('peak_tile'))}"
        + (f" of IPU {_e(r.get('peak_ipu'))}" if int(r.get("pipeline_stages") or 1) > 1 else "")
        + "</h2>",
        _table(["tensor", "opcode", "Keras layer", "kind", "bytes", "inside"], contrib_rows),
        _table(["Keras layer (or kind)", "bytes on the tile"], layer_rows),
        f"<h2>Liveness (tile {_e((r.get('liveness') or {}).get('tile', r.get('peak_tile')))}"
        + (f", IPU {_e((r.get('liveness') or {}).get('ipu', r.get('peak_ipu')))}"
           if int(r.get("pipeline_stages") or 1) > 1 else "") + ")</h2>",
        _liveness(r),
        "<h2>Top operations by cycles</h2>",
        _bars(top_rows, top_phases),
        _table(["instruction", "opcode", "Keras layer", "cycles", "compute", "exchange", "sync",
                "supersteps", "tiles"], top_table),
        "<h2>Cycles by Keras layer</h2>",
        _bars(layer_bars, ("cycles",)),
        "<h2>BSP timeline</h2>",
        _timeline(r),
        "<h2>Batch-size sweep</h2>",
        _sweep(r),
        "<h2>Largest micro-batch</h2>",
        _max_batch(r),
        "<h2>Assumptions</h2>", f"<ul>{assumptions}</ul>",
    ]
    if notes:
        parts += ["<h2>Notes from the planner</h2>", f"<ul>{notes}</ul>"]
    parts += ["<h2>Preset</h2>", _table(["figure", "value"], preset_rows), "</body></html>\n"]
    return "".join(parts)


def save_html(report: dict[str, Any], path: str) -> str:
    """Writes :func:`render_html` of ``report`` to ``path``; returns the path."""
    text = render_html(report)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
