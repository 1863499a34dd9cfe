"""TTFT P90 vs load, one line per policy (matplotlib, headless Agg backend), written next to a benchmark's JSON."""

from __future__ import annotations

from pathlib import Path


def ttft_vs_load(
    path: Path, title: str, panels: dict[str, dict[str, list[tuple[float, float]]]], ylabel: str = "TTFT P90 (s)"
) -> str:
    """`panels`: panel title -> {policy: [(load, value), ...]}; one subplot per panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(panels))
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 4.0), dpi=110, squeeze=False)
    for ax, (panel, series) in zip(axes[0], panels.items()):
        for name, pts in series.items():
            pts = sorted(pts)
            ax.plot([x * 100 for x, _ in pts], [y for _, y in pts], marker="o", label=name)
        ax.set_xlabel("nominal load (%)")
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        ax.set_title(panel, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def ratio_vs_load(
    path: Path,
    title: str,
    panels: dict[str, dict[str, list[tuple[float, float | None, float | None, float | None]]]],
    reference: float = 1.0,
) -> str:
    """`panels`: panel title (the ratio) -> {series: [(load, ratio, ci_lo, ci_hi), ...]}; each series a line
    with its confidence interval as error bars, and a dashed line at `reference` (parity)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(panels))
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 4.0), dpi=110, squeeze=False)
    for ax, (panel, series) in zip(axes[0], panels.items()):
        for name, pts in series.items():
            pts = sorted(q for q in pts if q[1] is not None)
            xs = [x * 100 for x, *_ in pts]
            ys = [y for _, y, _, _ in pts]
            lo = [y - (a if a is not None else y) for _, y, a, _ in pts]
            hi = [(b if b is not None else y) - y for _, y, _, b in pts]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=name)
        ax.axhline(reference, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xlabel("nominal load (%)")
        ax.set_ylabel("ratio (95% bootstrap interval)")
        ax.set_title(panel, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return str(path)
