"""Memory-plan benchmark: sglite's KV tokens against the ideal and two wrong pricing rules.

For every target in shared/model_configs with a DFLASH or DSPARK draft, over data-centre topologies,
rank 0 is planned with the runtime's own code (pools built on `meta`). Then, from the same budget:
- ideal      = (budget - fixed) // (target_cell + draft_cell): exact bytes per token, no page rounding,
               where fixed = the plan's bytes that do not scale per token (request table, state slots);
- layer-ratio= the EAGLE rule applied to a block draft: cell = ceil(target_cell * (L + D) / L);
- raw-tp     = the draft priced at --tp-size instead of the live attn_tp_size (SGLang #38202).
For each wrong rule it prints the tokens it would plan and the bytes those tokens really need beyond
the budget (> 0: the draft pool allocation runs out of memory at start-up; < 0: memory left idle).
The ratio printed per row is sglite tokens / ideal tokens. Each draft keeps its published attention
geometry (qwen3-8b-dflash-b16: 5 layers x 8 KV heads x head_dim 128, bf16; the DSPARK draft likewise)
and is re-pointed at each target (num_target_layers, hidden size), as if trained for it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Optional

from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.mem_cache.pool_plan import MemoryPlanError
from sglite.srt.planner import plan_rank
from sglite.srt.server_args import ServerArgs

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG_DIR = os.path.abspath(os.path.join(HERE, "..", "..", "shared", "model_configs"))

TARGETS = [
    "qwen3-8b.json",
    "qwen3-14b.json",
    "llama-3.1-8b-instruct.json",
    "gpt-oss-120b.json",
    "gemma-3-27b-it.json",
    "deepseek-v3.json",
    "kimi-k2-instruct.json",
    "qwen3-next-80b-a3b-instruct.json",
    "kimi-linear-48b-a3b-instruct.json",
]
DRAFTS = {"DFLASH": "qwen3-8b-dflash-b16.json", "DSPARK": "dspark-qwen3-8b-block7.json"}
# (label, tp, dp, dp_attention, attn_cp)
TOPOLOGIES = [
    ("tp8", 8, 1, False, 1),
    ("tp16", 16, 1, False, 1),
    ("tp8 dp8 dpattn", 8, 8, True, 1),
    ("tp16 dp16 dpattn", 16, 16, True, 1),
    ("tp16 dp8 cp2 dpattn", 16, 8, True, 2),
]


@dataclass
class Row:
    """One (target, draft, topology) comparison at rank 0."""

    target: str
    draft: str
    topology: str
    attn_tp_size: int
    budget_bytes: int
    target_cell_bytes: int
    draft_cell_bytes: int
    sglite_tokens: int
    ideal_tokens: int
    layer_ratio_tokens: int
    layer_ratio_overcommit_bytes: int
    raw_tp_tokens: int
    raw_tp_overcommit_bytes: int
    raw_tp_draft_undercount: float  # draft bytes/token really needed / priced at tp_size
    planned_equals_allocated: bool

    @property
    def ratio(self) -> float:
        """sglite tokens / ideal tokens."""
        return self.sglite_tokens / self.ideal_tokens if self.ideal_tokens else 0.0


def retargeted_draft(draft_path: str, target: ModelConfig) -> ModelConfig:
    """The published draft's attention geometry, re-pointed at this target (layer ids by DFlash's rule)."""
    with open(draft_path) as f:
        raw = json.load(f)
    raw["num_target_layers"] = target.num_hidden_layers
    raw["hidden_size"] = target.hidden_size
    raw.pop("target_layer_ids", None)
    if isinstance(raw.get("dflash_config"), dict):
        raw["dflash_config"] = {k: v for k, v in raw["dflash_config"].items() if k != "target_layer_ids"}
    return ModelConfig.from_dict(raw, path=draft_path)


def compare(target_path: str, draft_path: str, algo: str, topo: tuple, device_gb: float, mem_frac: float) -> Optional[Row]:
    """Plan rank 0 and price the same budget with the ideal and the two wrong rules."""
    label, tp, dp, dpattn, cp = topo
    sa = ServerArgs(
        model_path=target_path, device="cuda", tp_size=tp, dp_size=dp, enable_dp_attention=dpattn,
        attn_cp_size=cp, mem_fraction_static=mem_frac, speculative_algorithm=algo,
        speculative_draft_model_path=draft_path,
    )
    sa.validate()
    target = ModelConfig.from_path(target_path)
    draft = retargeted_draft(draft_path, target)
    try:
        rep = plan_rank(sa, target, 0, draft_model_config=draft, device_memory_bytes=int(device_gb * 2**30))
    except MemoryPlanError:
        return None  # the weights alone do not fit this topology
    budget, t_cell, d_cell = rep.budget_bytes, rep.target_cell_bytes, rep.draft_cell_bytes or 0
    exact = t_cell + d_cell
    # Bytes that do not scale per KV token (request table, recurrent-state slots) come first.
    fixed = rep.planned_total_bytes - rep.max_total_num_tokens * exact
    per_token_budget = budget - fixed
    ideal = per_token_budget // exact

    layers, draft_layers = target.num_hidden_layers, draft.num_hidden_layers
    lr_cell = (t_cell * (layers + draft_layers) + layers - 1) // layers
    lr_tokens = per_token_budget // lr_cell

    heads_live = draft.get_num_kv_heads(rep.attn_tp_size)
    heads_tp = draft.get_num_kv_heads(tp)
    d_cell_tp = d_cell * heads_tp // heads_live
    tp_tokens = per_token_budget // (t_cell + d_cell_tp)

    return Row(
        target=os.path.basename(target_path).removesuffix(".json"),
        draft=algo,
        topology=label,
        attn_tp_size=rep.attn_tp_size,
        budget_bytes=budget,
        target_cell_bytes=t_cell,
        draft_cell_bytes=d_cell,
        sglite_tokens=rep.max_total_num_tokens,
        ideal_tokens=ideal,
        layer_ratio_tokens=lr_tokens,
        layer_ratio_overcommit_bytes=lr_tokens * exact - per_token_budget,
        raw_tp_tokens=tp_tokens,
        raw_tp_overcommit_bytes=tp_tokens * exact - per_token_budget,
        raw_tp_draft_undercount=heads_live / heads_tp,
        planned_equals_allocated=all(p.planned_bytes == p.allocated_bytes for p in rep.pools),
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:+.2f}"


def format_rows(rows: list[Row]) -> str:
    """A table; over-commit in GiB (+ = OOM at start-up, - = idle)."""
    head = (f"{'target':<30}{'draft':<7}{'topology':<21}{'attn_tp':>7}{'sglite tok':>12}{'ideal tok':>12}"
            f"{'ratio':>8}{'layer-ratio GiB':>16}{'raw-tp GiB':>12}{'plan==alloc':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.target:<30}{r.draft:<7}{r.topology:<21}{r.attn_tp_size:>7}{r.sglite_tokens:>12}{r.ideal_tokens:>12}"
            f"{r.ratio:>8.4f}{_gib(r.layer_ratio_overcommit_bytes):>16}{_gib(r.raw_tp_overcommit_bytes):>12}"
            f"{str(r.planned_equals_allocated):>12}"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> None:
    """Bar chart of over-commit per case for the two wrong rules."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r.draft == "DFLASH"]
    labels = [f"{r.target}\n{r.topology}" for r in sel]
    xs = range(len(sel))
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(sel)), 5))
    ax.bar([x - 0.2 for x in xs], [r.layer_ratio_overcommit_bytes / 2**30 for r in sel], 0.4, label="layer-ratio rule")
    ax.bar([x + 0.2 for x in xs], [r.raw_tp_overcommit_bytes / 2**30 for r in sel], 0.4, label="draft priced at tp_size")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_ylabel("bytes needed beyond the KV budget (GiB)\n> 0: OOM at start-up, < 0: idle")
    ax.set_title("DFLASH draft (qwen3-8b-dflash-b16 geometry) — what wrong pricing rules cost, rank 0, H200 141 GB")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=90, fontsize=7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[list[str]] = None) -> int:
    """Run every comparison and print the table (and JSON / a plot on request)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config-dir", default=DEFAULT_CONFIG_DIR, help="Folder with the model config.json files")
    p.add_argument("--device-memory-gb", type=float, default=141.0)
    p.add_argument("--mem-fraction-static", type=float, default=0.9)
    p.add_argument("--json", dest="json_out", help="Write the rows as JSON here")
    p.add_argument("--plot", help="Write a PNG bar chart here")
    args = p.parse_args(argv)
    if not os.path.isdir(args.config_dir):
        print(f"bench_memory_plan: --config-dir {args.config_dir} not found", file=sys.stderr)
        return 2
    rows: list[Row] = []
    skipped = []
    for t in TARGETS:
        for algo, d in DRAFTS.items():
            for topo in TOPOLOGIES:
                row = compare(os.path.join(args.config_dir, t), os.path.join(args.config_dir, d), algo, topo,
                              args.device_memory_gb, args.mem_fraction_static)
                if row is None:
                    skipped.append(f"{t} {topo[0]}")
                else:
                    rows.append(row)
    print(format_rows(rows))
    worst_lr = max(rows, key=lambda r: r.layer_ratio_overcommit_bytes)
    worst_tp = max(rows, key=lambda r: r.raw_tp_overcommit_bytes)
    print(f"\n{len(rows)} cases; sglite/ideal tokens: min {min(r.ratio for r in rows):.4f}, "
          f"mean {sum(r.ratio for r in rows) / len(rows):.4f}; planned == allocated in "
          f"{sum(r.planned_equals_allocated for r in rows)}/{len(rows)}")
    print(f"worst layer-ratio over-commit: {_gib(worst_lr.layer_ratio_overcommit_bytes)} GiB "
          f"({worst_lr.target}, {worst_lr.draft}, {worst_lr.topology})")
    print(f"worst raw-tp over-commit:      {_gib(worst_tp.raw_tp_overcommit_bytes)} GiB "
          f"({worst_tp.target}, {worst_tp.draft}, {worst_tp.topology}); draft under-counted "
          f"{max(r.raw_tp_draft_undercount for r in rows):.0f}x per token at worst")
    if skipped:
        print(f"does not fit (weights exceed memory): {', '.join(skipped)}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([asdict(r) | {"ratio": r.ratio} for r in rows], f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
