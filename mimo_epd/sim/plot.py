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
