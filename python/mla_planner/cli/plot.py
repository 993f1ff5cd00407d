"""The simulate picture: per-step scratch of both policies against the
budget and the headroom, and, for traces long enough to have one, the
distribution of the per-step scratch.

One picture cannot draw every trace length the same way: a handful of steps
are discrete points (markers, integer ticks), a few thousand fit as lines,
and beyond the plot's width in pixels lines overdraw into solid blocks, so
long traces draw the maximum of each bin of steps, and a second panel shows
the distribution over all steps. Every figure is in GiB, the axis's unit.
"""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.axis import Axis  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter  # noqa: E402

from .records import NO_FAILURE, Records  # noqa: E402
from .units import GIB  # noqa: E402

COLORS = {"stock": "tab:red", "planned": "tab:blue"}
LABELS = {"stock": "stock vLLM", "planned": "mla-planner"}
MARKERS = {"stock": "o", "planned": "s"}
# Up to this many steps each is a marker; up to MAX_LINE_STEPS a line point
# (about the plot's width in pixels); beyond, BINS bins of steps.
MAX_MARKER_STEPS = 60
MAX_TICKED_STEPS = 20  # a tick on every step
MAX_LINE_STEPS = 1500
BINS = 500
Float = npt.NDArray[np.float64]


def _gib(n: float) -> str:
    """Four significant digits: 1023.8 MiB reads 0.9998 GiB, not a rounded 1.00."""
    return f"{n / GIB:.4g} GiB"


def render_png(rec: Records, *, budget_bytes: int, headroom_bytes: int, title: str) -> bytes:
    n = len(rec)
    gib = {p: np.frombuffer(rec.policies[p].peak_bytes, dtype=np.int64) / GIB for p in COLORS}
    failed = {p: np.array([f != NO_FAILURE for f in rec.policies[p].failures], dtype=bool) for p in COLORS}
    positive = np.concatenate([g[g > 0] for g in gib.values()])
    lines_gib = (budget_bytes / GIB, headroom_bytes / GIB)
    low = min(float(positive.min()) if positive.size else min(lines_gib), *lines_gib) / 2
    high = max(float(positive.max()) if positive.size else 0.0, *lines_gib) * 2

    with_cdf = n > MAX_MARKER_STEPS
    fig, axes = plt.subplots(
        1, 2 if with_cdf else 1, figsize=(13, 4.8), dpi=110, squeeze=False,
        gridspec_kw={"width_ratios": [3, 1]} if with_cdf else None,
    )  # fmt: skip
    ax = axes[0][0]
    for name in COLORS:
        worst = _gib(float(gib[name].max(initial=0.0)) * GIB)
        label = f"{LABELS[name]} (worst {worst})"
        if n <= MAX_MARKER_STEPS:
            _markers(ax, gib[name], name, label, low)
        elif n <= MAX_LINE_STEPS:
            shown = np.where(gib[name] > 0, gib[name], np.nan)  # log axis: no zero
            ax.plot(np.arange(1, n + 1), shown, lw=0.8, color=COLORS[name], drawstyle="steps-mid", label=label)
        else:
            x, top = _bin_max(gib[name])
            ax.step(x, np.where(top > 0, top, np.nan), where="post", lw=0.9, color=COLORS[name], label=label)
        _failures(ax, gib[name], failed[name], name)
    _limits(ax, budget_bytes, headroom_bytes)
    ax.set_yscale("log")  # before _log_axis: setting the scale resets the ticks
    _log_axis(ax.yaxis)
    ax.set_ylim(low, high)
    ax.set_ylabel("attention scratch per step (GiB)")
    ax.set_xlabel(_x_label(n))
    if n <= MAX_TICKED_STEPS:
        ax.set_xticks(range(1, n + 1))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if n <= MAX_MARKER_STEPS:
        ax.set_xlim(0.5, n + 0.5)
    else:
        ax.set_xlim(1, n)
    ax.grid(True, which="major", alpha=0.3)
    if with_cdf:
        _distribution(axes[0][1], gib, budget_bytes, headroom_bytes, low, high)
    fig.suptitle(title, fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _x_label(n: int) -> str:
    if n <= MAX_LINE_STEPS:
        return "scheduler step"
    return f"scheduler step (lines: maximum of each {-(-n // BINS):,} steps; crosses: one per bin)"


def _markers(ax: Axes, gib: Float, name: str, label: str, floor: float) -> None:
    """One marker per step; a step without sparse launches (0 bytes, off a
    log axis) sits hollow on the bottom edge."""
    steps = np.arange(1, len(gib) + 1)
    # Side by side, so equal values of the two policies stay visible.
    shift = -0.12 if name == "stock" else 0.12
    some = gib > 0
    if some.any():
        ax.scatter(steps[some] + shift, gib[some], marker=MARKERS[name], s=36, color=COLORS[name], label=label, zorder=3)
    if (~some).any():
        ax.scatter(steps[~some] + shift, np.full((~some).sum(), floor), marker=MARKERS[name], s=36, facecolors="none",
                   edgecolors=COLORS[name], clip_on=False, zorder=3,
                   label=f"{LABELS[name]}: no sparse launch (0 GiB, on the axis)")  # fmt: skip


def _bin_max(gib: Float) -> tuple[Float, Float]:
    """(first step, maximum) per bin of steps."""
    width = -(-len(gib) // BINS)
    pad = -len(gib) % width
    binned = np.pad(gib, (0, pad)).reshape(-1, width)  # zero padding: the scratch is >= 0
    first: Float = np.arange(len(binned), dtype=np.float64) * width + 1.0
    top: Float = binned.max(axis=1)
    return first, top


def _log_axis(axis: Axis, subs: tuple[float, ...] = (1.0, 2.0, 5.0)) -> None:
    """Ticks at `subs` per decade, written as plain numbers (0.02, 5, 20):
    a trace spanning less than a decade still gets labels."""
    axis.set_major_locator(LogLocator(subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _failures(ax: Axes, gib: Float, failed: npt.NDArray[np.bool_], name: str) -> None:
    """Steps over a hard limit as crosses; in binned traces one cross per
    bin, so thousands of them stay countable instead of one smear."""
    if not failed.any():
        return
    steps = np.arange(1, len(gib) + 1)
    x, y = steps[failed].astype(float), gib[failed]
    if len(gib) > MAX_LINE_STEPS:
        width = -(-len(gib) // BINS)
        bins = (x - 1) // width
        first = np.unique(bins, return_index=True)[1]
        x, y = bins[first] * width + 1 + width / 2, np.maximum.reduceat(y, first)
    ax.scatter(x, y, marker="x", s=40, linewidths=1.5, color="black", zorder=4,
               label=f"{LABELS[name]}: {int(failed.sum()):,} steps over a hard limit (x)")  # fmt: skip


def _limits(ax: Axes, budget_bytes: int, headroom_bytes: int, *, vertical: bool = False) -> None:
    line = ax.axvline if vertical else ax.axhline
    line(headroom_bytes / GIB, color="black", ls=":", lw=1.2, label=f"headroom {_gib(headroom_bytes)}")
    line(budget_bytes / GIB, color="tab:green", ls="--", lw=1.2, label=f"budget {_gib(budget_bytes)}")


def _distribution(ax: Axes, gib: dict[str, Float], budget_bytes: int, headroom_bytes: int, low: float, high: float) -> None:
    """Share of steps needing more than x: the tail a time series hides."""
    for name, g in gib.items():
        values = np.sort(g)
        above = 1.0 - np.arange(1, len(values) + 1) / len(values)  # share strictly above each value
        keep = (values > 0) & (above > 0)
        ax.step(values[keep], above[keep], where="post", color=COLORS[name], lw=1.2)
    _limits(ax, budget_bytes, headroom_bytes, vertical=True)
    ax.set_xscale("log")
    ax.set_yscale("log")
    _log_axis(ax.xaxis, subs=(1.0,))  # a narrow panel: decades only
    ax.set_xlim(low, high)
    ax.set_xlabel("attention scratch (GiB)")
    ax.set_ylabel("share of steps needing more")
    ax.grid(True, which="major", alpha=0.3)
