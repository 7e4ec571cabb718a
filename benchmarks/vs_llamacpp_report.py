"""The vs-llama.cpp table: per-system numbers (median over rounds), the ratios of
tierserve to the best llama-server config, the fraction of the machine's bounds reached,
and a PNG of the same (matplotlib, the `bench` extra)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.machine_bounds import Bounds, bandwidth_fraction, compute_fraction, decode_bound_tok_s

# (header, row key, scale, format)
COLUMNS: tuple[tuple[str, str, float, str], ...] = (
    ("out tok/s", "output_tok_per_s", 1, ".1f"), ("TTFT mean s", "ttft_mean_s", 1, ".2f"),
    ("TTFT p99 s", "ttft_p99_s", 1, ".2f"), ("ITL p99 ms", "itl_p99_s", 1e3, ".0f"),
    ("b1 decode tok/s", "decode_tok_s", 1, ".1f"), ("compute %", "compute_frac", 100, ".0f"),
    ("b1 BW %", "bandwidth_frac", 100, ".0f"), ("b1 bound tok/s", "decode_bound_tok_s", 1, ".0f"),
    ("ok", "completed", 1, ".0f"), ("short", "short_outputs", 1, ".0f"),
)
# Targets of issue 22: tierserve over the best llama-server config, and fractions of the
# machine's bounds (batch-1 decode of the read bandwidth, the workload of the compute bound).
TARGET_THROUGHPUT = 2.0
TARGET_TTFT = 0.6
TARGET_DECODE = 2.0
TARGET_BANDWIDTH = 0.5
TARGET_COMPUTE = 0.7


def median_rows(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's numbers over rounds: the median of each number (None where none has one)."""
    out: dict[str, Any] = {}
    for key in rounds[0]:
        values = [r[key] for r in rounds if r.get(key) is not None]
        numeric = values and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        out[key] = statistics.median(values) if numeric else (values[0] if values else None)
    return out


def add_bounds(row: dict[str, Any], bounds: Bounds, params: int) -> dict[str, Any]:
    """Fractions of the compute bound (the whole workload) and bandwidth bound (batch-1 decode)."""
    tokens = row["prompt_tokens"] + row["output_tokens"]
    gflops = bounds.gflops_for(row["weight_dtype"])
    bound = decode_bound_tok_s(row["weight_bytes"], bounds.read_gb_s)
    return row | {
        "compute_frac": compute_fraction(params, tokens, row["duration_s"], gflops) if tokens else None,
        "decode_bound_tok_s": bound,
        "bandwidth_frac": bandwidth_fraction(row["decode_tok_s"], row["weight_bytes"], bounds.read_gb_s)
        if row.get("decode_tok_s") else None,
    }


def best(rows: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    scored = [r for r in rows if r.get(key) is not None]
    return max(scored, key=lambda r: r[key]) if scored else None


def ratios(ours: dict[str, Any], peers: list[dict[str, Any]]) -> dict[str, Any]:
    """tierserve over the best llama-server config: throughput and TTFT against the config with
    the highest throughput, batch-1 decode against the config with the fastest decode."""
    top, fastest = best(peers, "output_tok_per_s"), best(peers, "decode_tok_s")
    out: dict[str, Any] = {"label": ours["label"]}
    if top is not None:
        out["vs_throughput"] = top["label"]
        out["throughput"] = ours["output_tok_per_s"] / top["output_tok_per_s"]
        if ours.get("ttft_mean_s") and top.get("ttft_mean_s"):
            out["ttft"] = ours["ttft_mean_s"] / top["ttft_mean_s"]
    if fastest is not None and ours.get("decode_tok_s"):
        out["vs_decode"] = fastest["label"]
        out["decode"] = ours["decode_tok_s"] / fastest["decode_tok_s"]
    out["bandwidth"], out["compute"] = ours.get("bandwidth_frac"), ours.get("compute_frac")
    out["met"] = {
        "throughput": out.get("throughput", 0) >= TARGET_THROUGHPUT,
        "ttft": out.get("ttft", float("inf")) <= TARGET_TTFT,
        "decode": out.get("decode", 0) >= TARGET_DECODE,
        "bandwidth": (out["bandwidth"] or 0) >= TARGET_BANDWIDTH,
        "compute": (out["compute"] or 0) >= TARGET_COMPUTE,
    }
    return out


def cell(value: Any, scale: float, fmt: str) -> str:
    return "-" if value is None else format(value * scale, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [("system", *(c[0] for c in COLUMNS))]
    lines += [(r["label"], *(cell(r.get(k), sc, f) for _, k, sc, f in COLUMNS)) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = [" | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
            for line in lines]
    text.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(text)


def ratio_lines(all_ratios: list[dict[str, Any]]) -> list[str]:
    def mark(ok: bool) -> str:
        return "met" if ok else "NOT met"

    lines = []
    for r in all_ratios:
        met = r["met"]
        if "throughput" in r:
            lines.append(f"{r['label']}: out tok/s {r['throughput']:.2f}x {r['vs_throughput']} "
                         f"(target >= {TARGET_THROUGHPUT:.0f}x: {mark(met['throughput'])})")
        if "ttft" in r:
            lines.append(f"{r['label']}: mean TTFT {r['ttft']:.2f}x {r['vs_throughput']} "
                         f"(target <= {TARGET_TTFT}x: {mark(met['ttft'])})")
        if "decode" in r:
            lines.append(f"{r['label']}: batch-1 decode {r['decode']:.2f}x {r['vs_decode']} "
                         f"(target >= {TARGET_DECODE:.0f}x: {mark(met['decode'])})")
        if r.get("bandwidth") is not None:
            lines.append(f"{r['label']}: batch-1 decode at {r['bandwidth']:.0%} of the read bandwidth bound "
                         f"(target >= {TARGET_BANDWIDTH:.0%}: {mark(met['bandwidth'])})")
        if r.get("compute") is not None:
            # Over 100 %: the bound is the float dtype's FMA rate, and quantized matmuls that
            # run integer dot products (tierserve's int4 kernels, AVX2's vpmaddubsw) outrun it.
            beyond = " (past the float bound: integer dot products)" if r["compute"] > 1 else ""
            lines.append(f"{r['label']}: the workload at {r['compute']:.0%} of the compute bound{beyond} "
                         f"(target >= {TARGET_COMPUTE:.0%}: {mark(met['compute'])})")
    return lines


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Four bar panels of the table; False (with a message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install -e '.[bench]')")
        return False
    panels = (("useful output tok/s", "output_tok_per_s", 1),
              ("mean TTFT, s", "ttft_mean_s", 1), ("ITL p99, ms", "itl_p99_s", 1e3),
              ("batch-1 decode tok/s (bar) vs bandwidth bound (dash)", "decode_tok_s", 1))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    labels = [r["label"] for r in rows]
    colors = ["tab:blue" if r["system"] == "tierserve" else "tab:gray" for r in rows]
    for ax, (name, key, scale) in zip(axes.flat, panels):
        values = [(r.get(key) or 0) * scale for r in rows]
        ax.bar(range(len(rows)), values, color=colors)
        if key == "decode_tok_s":
            for i, r in enumerate(rows):
                ax.hlines(r["decode_bound_tok_s"], i - 0.4, i + 0.4, colors="k", linestyles="dashed")
        ax.set_title(name)
        ax.set_xticks(range(len(rows)), labels, rotation=20, ha="right", fontsize=8)
        for i, (v, r) in enumerate(zip(values, rows)):  # "-": this run has no such number
            ax.annotate("-" if r.get(key) is None else f"{v:.1f}", (i, v), ha="center", va="bottom", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
