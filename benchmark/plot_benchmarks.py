"""PNG plots of the throughput benchmarks from their --result-file JSON (for docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional


def _bars(ax, groups: list[str], series: dict[str, list[float]], ylabel: str, title: str) -> None:
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)


def main(argv: Optional[list[str]] = None) -> int:
    """Plot bench_vs_transformers, bench_spec and bench_peers results side by side."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--vs-transformers", help="bench_vs_transformers.py --result-file JSON")
    p.add_argument("--spec", help="bench_spec.py --result-file JSON")
    p.add_argument("--peers", help="bench_peers.py --result-file JSON (offline and/or online panels)")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args(argv)
    peers = json.load(open(args.peers)) if args.peers else {}
    peer_panels = [k for k in ("offline", "online") if peers.get(k)]
    panels = [x for x in (args.vs_transformers, args.spec) if x] + peer_panels
    if not panels:
        print("plot_benchmarks: give --vs-transformers, --spec and/or --peers", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4))
    axes = [axes] if len(panels) == 1 else list(axes)
    ax_iter = iter(axes)
    if args.vs_transformers:
        rows = json.load(open(args.vs_transformers))
        _bars(next(ax_iter), [f"conc {r['concurrency']}" for r in rows],
              {"transformers generate": [r["transformers_tok_s"] for r in rows],
               "sglite Engine": [r["sglite_tok_s"] for r in rows]},
              "output tok/s", "sglite vs transformers (default model, CPU)")
    if args.spec:
        rows = json.load(open(args.spec))  # bench_spec: one row per (concurrency, variant)
        concs = sorted({r["concurrency"] for r in rows})
        variants = list(dict.fromkeys(r["variant"] for r in rows))
        tok = {(r["concurrency"], r["variant"]): r["tok_s"] for r in rows}
        _bars(next(ax_iter), [f"conc {c}" for c in concs], {v: [tok[c, v] for c in concs] for v in variants},
              "output tok/s", "DFLASH vs no draft (default pair, held-out prompts, CPU)")
    dtype = f", {peers['dtype']}" if peers and peers.get("dtype", "float32") != "float32" else ""  # --dtype bfloat16
    for panel in peer_panels:  # (x key, x label, metric suffix, y label, title) per bench_peers table
        xkey, xlabel, suffix, ylabel, what = {
            "offline": ("batch_size", "batch", "_decode_tok_s", "decode tok/s", "offline decode"),
            "online": ("concurrency", "conc", "_output_throughput", "output tok/s", "online serving"),
        }[panel]
        rows = peers[panel]
        engines = [k[: -len(suffix)] for k in rows[0] if k.endswith(suffix)]
        _bars(next(ax_iter), [f"{xlabel} {r[xkey]}" for r in rows], {e: [r[e + suffix] for r in rows] for e in engines},
              ylabel, f"{what}, {peers['model']}{dtype}, {peers['threads']} thread(s)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
