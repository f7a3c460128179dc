#!/usr/bin/env python3
"""Draws docs/src/benchmarks/peer.svg, the chart of the side by side with
pg-transactional-outbox on the Results page, from the figures of that
page's table (written out below: change them together).

    python3 scripts/peer-chart.py

Each bar is a range over the runs: solid up to the lowest run, lighter up
to the highest. No plotting library: the SVG is written by hand.
"""
import math
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "src", "benchmarks", "peer.svg")

# The Results page's table "Against a peer, at the rates services run":
# (rate, Switchyard low, high, peer low, high).
CPU_MS = [  # PostgreSQL CPU per event, the writer's statements included
    ("100 events/s", 0.590, 0.765, 1.640, 1.945),
    ("500 events/s", 0.330, 0.419, 1.164, 1.424),
]
P99_MS = [  # commit to consumer, 99th percentile
    ("100 events/s", 2.6, 3.1, 8.1, 8.2),
    ("500 events/s", 4.2, 4.2, 1700.0, 4800.0),
]
SWITCHYARD = ("Switchyard, replication mode on the service's own table", "#1f77b4", "#9ecae1")
PEER = ("pg-transactional-outbox 0.5.7", "#d62728", "#f4a3a4")

WIDTH, HEIGHT = 860, 380
TOP, BOTTOM = 60, 310  # plot area, y
PANELS = [  # x from, x to, title, figures, log scale
    (70, 400, "PostgreSQL CPU per event (ms)", CPU_MS, False),
    (500, 830, "Commit to consumer, p99 (ms, log scale)", P99_MS, True),
]


def fmt(value):
    if value >= 1000:
        return f"{value / 1000:g} s"
    return f"{value:g}"


def panel(x0, x1, title, figures, log):
    out = [f'<text x="{(x0 + x1) / 2}" y="{TOP - 22}" text-anchor="middle" font-size="13">{title}</text>']
    if log:
        lo, hi = 1.0, 10000.0
        ticks = [1, 10, 100, 1000, 10000]

        def y(v):
            return BOTTOM - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * (BOTTOM - TOP)
    else:
        hi = 2.0
        ticks = [0, 0.5, 1.0, 1.5, 2.0]

        def y(v):
            return BOTTOM - v / hi * (BOTTOM - TOP)

    for tick in ticks:
        ty = y(tick)
        out.append(f'<line x1="{x0}" y1="{ty:.1f}" x2="{x1}" y2="{ty:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{x0 - 6}" y="{ty + 4:.1f}" text-anchor="end">{fmt(tick)}</text>')
    out.append(f'<line x1="{x0}" y1="{BOTTOM}" x2="{x1}" y2="{BOTTOM}" stroke="black"/>')
    out.append(f'<line x1="{x0}" y1="{TOP}" x2="{x0}" y2="{BOTTOM}" stroke="black"/>')
    group = (x1 - x0) / len(figures)
    bar = group / 3
    for i, (rate, s_lo, s_hi, p_lo, p_hi) in enumerate(figures):
        gx = x0 + i * group
        for j, ((_, dark, light), low, high) in enumerate([(SWITCHYARD, s_lo, s_hi), (PEER, p_lo, p_hi)]):
            bx = gx + group / 2 - bar + j * bar
            base = BOTTOM
            out.append(
                f'<rect x="{bx:.1f}" y="{y(low):.1f}" width="{bar - 4:.1f}" height="{base - y(low):.1f}" fill="{dark}"/>'
            )
            if high > low:
                out.append(
                    f'<rect x="{bx:.1f}" y="{y(high):.1f}" width="{bar - 4:.1f}" height="{y(low) - y(high):.1f}" fill="{light}"/>'
                )
            label = fmt(low) if high == low else f"{fmt(low)}-{fmt(high)}"
            out.append(
                f'<text x="{bx + (bar - 4) / 2:.1f}" y="{y(high) - 5:.1f}" text-anchor="middle" font-size="10">{label}</text>'
            )
        out.append(f'<text x="{gx + group / 2:.1f}" y="{BOTTOM + 18}" text-anchor="middle">{rate}</text>')
    return out


def main():
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        '<rect width="100%" height="100%" fill="white"/>',
    ]
    for spec in PANELS:
        parts += panel(*spec)
    for k, (name, dark, _) in enumerate([SWITCHYARD, PEER]):
        lx = 110 + k * 400
        parts.append(f'<rect x="{lx}" y="{HEIGHT - 30}" width="12" height="12" fill="{dark}"/>')
        parts.append(f'<text x="{lx + 18}" y="{HEIGHT - 20}">{name}</text>')
    parts.append("</svg>")
    with open(OUT, "w") as f:
        f.write("\n".join(parts) + "\n")
    print(f"peer-chart: wrote {os.path.relpath(OUT, ROOT)}")


if __name__ == "__main__":
    main()
