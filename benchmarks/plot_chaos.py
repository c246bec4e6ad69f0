#!/usr/bin/env python3
"""Draws one chaos scenario's timeline (benchmarks/bench_chaos.py) as a PNG: both systems on
one figure, throughput per 100 ms bucket above, failed operations per bucket below, the
failure and its follow-up events marked with vertical lines. Needs matplotlib (the project
venv has it: scripts/setup_venv.sh).

    plot_chaos.py --timeline bench-out/chaos/kill-holder.json --out kill-holder.png
"""
import argparse
import json
import sys

COLORS = {"kvbridge": "tab:blue", "mooncake": "tab:orange"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeline", required=True, help="<scenario>.json written by bench_chaos")
    ap.add_argument("--out", required=True, help="PNG to write")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"plot_chaos: matplotlib is not available ({e}); run scripts/setup_venv.sh",
              file=sys.stderr)
        return 3
    with open(args.timeline) as f:
        doc = json.load(f)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), dpi=110, sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.3]})
    width = None
    for i, (system, run) in enumerate(sorted(doc["systems"].items())):
        tl = run["timeline"]
        step = tl["bucket_s"]
        width = step
        xs = [k * step for k in range(len(tl["mb_per_s"]))]
        color = COLORS.get(system, None)
        label = (f"{system}: {run['failed_ops']} failed ops, {run['stall_seconds']} s below "
                 "half throughput")
        top.step(xs, tl["mb_per_s"], where="post", color=color, linewidth=1.2, label=label,
                 zorder=3 if system == "kvbridge" else 2)
        # side by side within the bucket so both systems stay visible
        bottom.bar([x + step * (0.25 + 0.5 * i) for x in xs], tl["failed_ops"],
                   width=step * 0.5, color=color, label=system)
        for j, ev in enumerate(run["events"]):
            for ax in (top, bottom):
                ax.axvline(ev["t_s"], color=color, linestyle="--" if ev["t_s"] == doc["inject_s"]
                           else ":", linewidth=1.1)
            top.annotate(f"{system}: {ev['what']}", xy=(ev["t_s"], 1), xycoords=("data",
                         "axes fraction"), xytext=(4, -12 - 11 * (i + 2 * j)),
                         textcoords="offset points",
                         fontsize=7, color=color)
    top.set_ylabel("MB/s of puts + verified gets\n(per 100 ms bucket)")
    top.set_ylim(bottom=0)
    top.grid(True, alpha=0.3)
    top.legend(loc="lower left", fontsize=8)
    bottom.set_ylabel("failed ops\nper bucket")
    bottom.set_xlabel("seconds since the load started")
    bottom.grid(True, alpha=0.3)
    if width is not None:
        bottom.legend(loc="upper right", fontsize=8)
    top.set_title(f"chaos: {doc['scenario']} - {doc['description']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
