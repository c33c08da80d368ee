"""PNG plots of an eval run (matplotlib, Agg backend), drawn from the results mapping alone.

- ``expert_load.png``: expert load histogram, one panel per layer;
- ``routing_heatmap.png``: token x expert combine weights for the sample tokens, per layer;
- ``time_vs_tokens.png``: median time (with min-max bars) against token count per case,
  log-log, one panel per layer;
- ``device_load.png`` (``expert-parallel`` runs with ``load_balance``): pairs per device
  with static placement and with each replica count.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

#: At most this many layers get a panel (a sweep over every preset fits).
MAX_PANELS = 16


def _grid(n: int, w: float = 4.5, h: float = 3.2):
    if n == 1:
        w, h = max(w, 6.4), max(h, 4.4)
    cols = min(n, 4 if w < 6 else 2)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(w * cols, h * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def plot_expert_load(res: dict[str, Any], path: Path) -> None:
    layers = res["layers"][:MAX_PANELS]
    fig, axes = _grid(len(layers))
    for ax, lay in zip(axes, layers):
        s = lay["stats"]
        counts = np.asarray(s["expert_load"]["value"])
        ax.bar(np.arange(counts.size), counts, width=1.0, color="tab:blue")
        ax.axhline(counts.mean(), color="tab:red", lw=1, label=f"mean {counts.mean():.1f}")
        ax.set_title(
            f"{lay['label']}\nmax/mean {s['load_max_over_mean']['value']:.2f}, idle {s['idle_experts']['value']}",
            fontsize=9,
        )
        ax.set_xlabel("expert id")
        ax.set_ylabel(f"(token, slot) pairs of {s['tokens']['value']} tokens", fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle(f"{res['name']}: expert load")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_routing_heatmap(res: dict[str, Any], path: Path) -> None:
    layers = res["layers"][:MAX_PANELS]
    e_max = max(lay["moe_config"]["router"]["num_experts"] for lay in layers)
    fig, axes = _grid(len(layers), w=min(12.0, max(5.5, e_max / 25)), h=3.6)  # >= ~3 px per expert
    for ax, lay in zip(axes, layers):
        sample = lay["stats"]["sample"]
        e = lay["moe_config"]["router"]["num_experts"]
        ids = np.asarray(sample["expert_ids"], int)
        w = np.asarray(sample["weights"], float)
        m = np.zeros((ids.shape[0], e))
        np.add.at(m, (np.arange(ids.shape[0])[:, None], ids), w)
        im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="viridis")
        fig.colorbar(im, ax=ax, label="combine weight")
        ax.set_title(lay["label"], fontsize=9)
        ax.set_xlabel("expert id")
        ax.set_ylabel("token")
    fig.suptitle(f"{res['name']}: routing of the first {layers[0]['stats']['sample']['tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_time_vs_tokens(res: dict[str, Any], path: Path) -> bool:
    """Returns False (and writes nothing) when no case was timed."""
    layers = [lay for lay in res["layers"] if any(r["status"] == "ok" for r in lay["results"])][:MAX_PANELS]
    if not layers:
        return False
    fig, axes = _grid(len(layers))
    for ax, lay in zip(axes, layers):
        cases: dict[str, list] = {}
        for r in lay["results"]:
            if r["status"] == "ok":
                cases.setdefault(r["case"], []).append(r)
        for case, rs in cases.items():
            rs.sort(key=lambda r: r["tokens"])
            t = np.array([r["tokens"] for r in rs])
            med = np.array([r["time_median"]["value"] for r in rs]) * 1e3
            lo = med - np.array([r["time_min"]["value"] for r in rs]) * 1e3
            hi = np.array([r["time_max"]["value"] for r in rs]) * 1e3 - med
            ax.errorbar(t, med, yerr=[lo, hi], marker="o", capsize=3, label=case)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("median time (ms), bars min-max")
        ax.set_title(lay["label"], fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{res['name']}: time vs tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def write_plots(res: dict[str, Any], run_dir: Path) -> list[str]:
    """Writes the PNGs into ``run_dir``; returns their file names."""
    run_dir = Path(run_dir)
    out = []
    plot_expert_load(res, run_dir / "expert_load.png")
    out.append("expert_load.png")
    plot_routing_heatmap(res, run_dir / "routing_heatmap.png")
    out.append("routing_heatmap.png")
    if plot_time_vs_tokens(res, run_dir / "time_vs_tokens.png"):
        out.append("time_vs_tokens.png")
    return out


def plot_device_loads(res: dict[str, Any], path: Path) -> Path:
    """Grouped bars: pairs each device computed, static placement first, then each replica
    count of ``res["load_balance"]``; the mean as a line. Returns ``path``."""
    cases = [k for k in res["load_balance"] if k["status"] != "skipped"]
    before = np.asarray(cases[0]["device_load_before"], float)
    series = [("static", before)] + [(f"R={k['replicas']}", np.asarray(k["device_load_after"], float)) for k in cases]
    n, width = before.size, 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.4, 0.9 * n + 2), 4.0))
    for i, (label, v) in enumerate(series):
        ax.bar(
            np.arange(n) + (i - (len(series) - 1) / 2) * width,
            v,
            width,
            label=f"{label}: max/mean {v.max() / v.mean():.2f}",
        )
    ax.axhline(before.mean(), color="black", lw=1, ls="--", label="mean")
    ax.set_xlabel("device (expert axis)")
    ax.set_ylabel("(token, slot) pairs computed")
    c = res["config"]["load_balance"]
    ax.set_title(f"{res['name']}: device load, Zipf({c['zipf']}) routing, {c['tokens']} tokens", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
