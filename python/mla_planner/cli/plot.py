"""The simulate picture: per-step scratch of both policies against the
budget and the headroom."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .records import NO_FAILURE, Records  # noqa: E402
from .units import GIB, format_bytes  # noqa: E402

COLORS = {"stock": "tab:red", "planned": "tab:blue"}
# Beyond this many steps, plot each bin's maximum: spikes stay visible and
# drawing 100k-step traces stays fast.
MAX_POINTS = 5000
LABELS = {"stock": "stock vLLM", "planned": "mla-planner"}


def render_png(rec: Records, *, budget_bytes: int, headroom_bytes: int, title: str) -> bytes:
    n = len(rec)
    steps = np.arange(1, n + 1)
    width = -(-n // MAX_POINTS)  # steps per plotted point
    fig, ax = plt.subplots(figsize=(12, 4.8), dpi=110)
    for name in ("stock", "planned"):
        r = rec.policies[name]
        gib = np.frombuffer(r.peak_bytes, dtype=np.int64) / GIB
        x, y = _bin_max(steps, gib, width)
        shown = np.where(y > 0, y, np.nan)  # log axis: steps without sparse launches are left out
        ax.plot(x, shown, lw=0.7, color=COLORS[name], label=f"{LABELS[name]}: max {format_bytes(max(r.peak_bytes, default=0))}")
        failed = np.array([f != NO_FAILURE for f in r.failures], dtype=bool)
        if failed.any():
            ax.scatter(steps[failed], gib[failed], marker="x", s=28, color=COLORS[name], zorder=3,
                       label=f"{LABELS[name]}: {int(failed.sum())} steps over a hard limit")
    ax.axhline(headroom_bytes / GIB, color="black", ls=":", lw=1.2, label=f"headroom {headroom_bytes / GIB:g} GiB")
    ax.axhline(budget_bytes / GIB, color="tab:green", ls="--", lw=1.2, label=f"budget {budget_bytes / GIB:g} GiB")
    ax.set_yscale("log")
    ax.set_xlim(1, max(len(rec), 2))
    ax.set_xlabel("scheduler step" + (f" (lines: maximum of each {width} steps)" if width > 1 else ""))
    ax.set_ylabel("attention scratch per step (GiB)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _bin_max(x: np.ndarray, y: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    if width == 1:
        return x, y
    pad = -len(y) % width
    binned = np.pad(y, (0, pad)).reshape(-1, width).max(axis=1)
    return x[::width], binned
