#!/usr/bin/env python3
"""Plots the store demo's throughput timeline (bench-out/store-demo-timeline.csv) as a PNG.

The CSV has the columns t_s, pages_per_s, gbps, failures (one row per 250 ms bucket). The plot
shows GB/s over time, marks the moment a node was killed (--kill-at) with a vertical line, and
marks buckets with failed operations in red. Needs matplotlib (scripts/setup_venv.sh).
"""
import argparse
import csv
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", required=True, help="timeline CSV written by kvb_store_demo")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--title", default="kvbridge store demo: throughput over time")
    ap.add_argument("--kill-at", type=float, default=None,
                    help="seconds into the run when the node was killed")
    ap.add_argument("--kill-label", default="node killed (kill -9)")
    ap.add_argument("--mark", action="append", default=[], metavar="T=LABEL",
                    help="another event to mark (dotted line), e.g. '9.0=node declared dead'")
    args = ap.parse_args()

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"plot_timeline: matplotlib is not available ({e}); run scripts/setup_venv.sh",
              file=sys.stderr)
        return 3

    t, gbps, pages, failures = [], [], [], []
    with open(args.csv, newline="") as f:
        for row in csv.DictReader(f):
            t.append(float(row["t_s"]))
            gbps.append(float(row["gbps"]))
            pages.append(float(row["pages_per_s"]))
            failures.append(int(row["failures"]))
    if not t:
        print(f"plot_timeline: {args.csv} has no rows", file=sys.stderr)
        return 1

    # Each row is the average over the 250 ms bucket ending at t_s; start the steps at 0.
    step = t[1] - t[0] if len(t) > 1 else t[0]
    t = [max(0.0, t[0] - step)] + t
    gbps = [gbps[0]] + gbps
    pages = [pages[0]] + pages
    failures = [0] + failures

    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
    ax.step(t, gbps, where="pre", color="tab:blue", linewidth=1.6, label="GB/s (read + stored)")
    ax.fill_between(t, gbps, step="pre", color="tab:blue", alpha=0.15)
    ax.set_xlabel("time since the measured run started (s)")
    ax.set_ylabel("throughput (GB/s)")
    ax.set_xlim(0, max(t))
    top = max(gbps) if max(gbps) > 0 else 1.0
    ax.set_ylim(0, top * 1.25)
    ax.grid(True, alpha=0.3)

    # Pages per second on a second axis, scaled so both curves coincide (same bytes per page).
    ax2 = ax.twinx()
    ratio = (max(pages) / top) if top > 0 and max(pages) > 0 else 1.0
    ax2.set_ylim(0, top * 1.25 * ratio)
    ax2.set_ylabel("pages / s (128 KiB each)")

    bad = [(x, y) for x, y, n in zip(t, gbps, failures) if n > 0]
    if bad:
        ax.scatter([x for x, _ in bad], [y for _, y in bad], color="red", zorder=5,
                   label=f"buckets with failed ops ({sum(failures)} ops)")
    if args.kill_at is not None:
        ax.axvline(args.kill_at, color="tab:red", linestyle="--", linewidth=1.5)
        ax.annotate(f"{args.kill_label}\nt = {args.kill_at:.1f} s", xy=(args.kill_at, top * 1.2),
                    xytext=(6, -2), textcoords="offset points", color="tab:red", va="top",
                    fontsize=9, bbox=dict(facecolor="white", edgecolor="none", alpha=0.85))
    for i, m in enumerate(args.mark):
        at, _, label = m.partition("=")
        try:
            x = float(at)
        except ValueError:
            print(f"plot_timeline: --mark {m!r}: expected T=LABEL", file=sys.stderr)
            return 2
        ax.axvline(x, color="dimgray", linestyle=":", linewidth=1.3)
        ax.annotate(f"{label}\nt = {x:.1f} s", xy=(x, top * (0.35 - 0.13 * i)), xytext=(6, 0),
                    textcoords="offset points", color="dimgray", va="top", fontsize=8,
                    bbox=dict(facecolor="white", edgecolor="none", alpha=0.85))
    ax.set_title(args.title, fontsize=11)
    ax.legend(loc="lower left", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"plot_timeline: wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
