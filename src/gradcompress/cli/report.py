"""``report.png`` of ``gradcompress demo``: four panels in a 2x2 grid and one legend beside it.

* top left: training loss against the step;
* top right: training loss against the cumulative bytes each worker sent;
* bottom left: the Compressor's telemetry, the relative error of the averaged gradient
  on the monitored steps;
* bottom right: the final test accuracy (validation loss for ``--task lm``) per scheme.

Every scheme keeps one style (colour, dash pattern, marker) in all panels; the pairs
(colour, dash pattern) are distinct for up to 40 schemes. The figure is built on the Agg
canvas directly, so matplotlib's global backend is left as it is.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from .common import human_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: tab10: ten hues far apart (tab20's pairs of a dark and a light shade read as one colour)
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
          "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
#: one dash pattern per ten schemes: the colours repeat with the next pattern
DASHES = ("-", "--", "-.", ":")
#: eleven markers, so that two schemes of the same colour get different ones
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*", "h")
#: markers per curve on the loss panels (every point on the telemetry panel)
MARKERS_PER_CURVE = 8
TELEMETRY_CAPTION = ("Error-fed codecs show large per-step errors (often above 1): what they drop stays in "
                     "their residual and is delivered in later steps. Unbiased quantisers (qsgd, terngrad) "
                     "show their variance. Schemes whose average is exact are not drawn.")
#: characters per line of the caption under the telemetry panel
CAPTION_WIDTH = 95


def scheme_styles(count: int) -> list[dict]:
    """Line styles for ``count`` schemes: ``color``, ``linestyle`` and ``marker`` keyword arguments.

    The colour cycles through :data:`COLORS`, the dash pattern changes every ten schemes,
    the marker cycles through eleven; (colour, dash pattern) repeats only after 40 schemes.
    """
    return [{"color": COLORS[i % len(COLORS)], "linestyle": DASHES[(i // len(COLORS)) % len(DASHES)],
             "marker": MARKERS[i % len(MARKERS)]} for i in range(count)]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _bytes_tick(value: float, _pos=None) -> str:
    """A tick label of the bytes axis in decimal units: ``1 MB``, ``30 MB``."""
    return human_bytes(value).replace(".0 ", " ")


def _markevery(index: int, points: int) -> tuple[int, int]:
    """About :data:`MARKERS_PER_CURVE` markers on a curve, staggered per scheme so they do not pile up."""
    every = max(1, points // MARKERS_PER_CURVE)
    return (index * every // 5) % every, every


def _plot_loss(ax_step, ax_bytes, runs: list[dict], styles: list[dict], window: int) -> None:
    """Training loss (moving average) against the step and against the cumulative bytes sent per worker."""
    from matplotlib.ticker import FuncFormatter

    for i, (r, style) in enumerate(zip(runs, styles)):
        loss = smooth(r["loss"], window)
        line = dict(style, lw=1.4, ms=4.5, markevery=_markevery(i, len(loss)), label=r["scheme"])
        ax_step.plot(range(1, len(loss) + 1), loss, **line)
        if r["cumulative_bytes"]:
            ax_bytes.plot([max(b, 1) for b in r["cumulative_bytes"]], loss, **line)
    ax_step.set(xlabel="step", ylabel=f"training loss (log scale, moving average of {window} steps)",
                yscale="log", title="training loss vs step")
    ax_bytes.set(xlabel="cumulative bytes sent per worker (log scale)", ylabel="training loss (log scale)",
                 xscale="log", yscale="log", title="training loss vs bytes sent")
    ax_bytes.xaxis.set_major_formatter(FuncFormatter(_bytes_tick))
    for ax in (ax_step, ax_bytes):
        ax.grid(True, which="major", alpha=0.3)


def _plot_telemetry(ax, runs: list[dict], styles: list[dict]) -> None:
    """Relative error ||compressed - exact|| / ||exact|| of the averaged gradient on each monitored step."""
    for r, style in zip(runs, styles):
        hist = r.get("monitor_history") or []
        if hist and any(h[1] > 0 for h in hist):
            ax.plot([h[0] + 1 for h in hist], [max(h[1], 1e-6) for h in hist], **style, lw=1.2, ms=3.5,
                    label=r["scheme"])
    ax.axhline(1.0, color="black", lw=0.8, ls=(0, (1, 3)), zorder=0)
    ax.set(xlabel="step (monitored steps only)", ylabel="relative error (log scale; 1: as large as the average)",
           yscale="log", title="telemetry: relative error of the averaged gradient\n"
                 "\u2016compressed \u2212 exact\u2016 / \u2016exact\u2016 on each monitored step")
    ax.grid(True, which="major", alpha=0.3)
    ax.text(0.0, -0.12, textwrap.fill(TELEMETRY_CAPTION, CAPTION_WIDTH), transform=ax.transAxes, fontsize=8,
            style="italic", va="top", color="0.25")


def _is_lm(runs: list[dict]) -> bool:
    """Whether the runs are of ``--task lm`` (a validation loss instead of a test accuracy)."""
    return any(r.get("val_loss") is not None for r in runs)


def _metric_limits(values: list[float]) -> tuple[float, float]:
    """An x range that spreads the schemes' final figures apart and leaves room for their value labels."""
    lo, hi = min(values), max(values)
    pad = max(0.15 * (hi - lo), 0.003 * abs(hi), 1e-3)
    return lo - pad, hi + 2.5 * pad


def _plot_final(ax, runs: list[dict], styles: list[dict]) -> None:
    """One dot per scheme in its own colour and marker: the final test accuracy, or the validation loss (lm)."""
    lm = _is_lm(runs)
    values = [r["val_loss"] if lm else r["test_accuracy"] for r in runs]
    for i, (v, style) in enumerate(zip(values, styles)):
        ax.plot([v], [i], ls="none", ms=8, color=style["color"], marker=style["marker"])
        ax.annotate(f"{v:.3f}" if lm else f"{v:.1f}", (v, i), xytext=(8, 0), textcoords="offset points",
                    va="center", fontsize=8)
    ax.set_yticks(range(len(runs)), [r["scheme"] for r in runs], fontsize=8)
    ax.set_ylim(len(runs) - 0.5, -0.5)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_xlim(*_metric_limits(values))
    if lm:
        ax.set(xlabel="validation loss (nats per byte)", ylabel="scheme",
               title="final validation loss (lower is better)")
    else:
        ax.set(xlabel="test accuracy (%)", ylabel="scheme", title="final test accuracy (higher is better)")


def build_figure(runs: list[dict], workers: int) -> Figure:
    """The report as a matplotlib Figure on an Agg canvas: 2x2 data axes and one figure-level legend."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    fig = Figure(figsize=(16, 11), layout="constrained")
    FigureCanvasAgg(fig)
    # each row lays out on its own: long scheme names widen only theirs (matplotlib's stubs: a SubFigure or an array)
    top, bottom = fig.subfigures(2, 1)  # type: ignore[misc]
    ax_step, ax_bytes = top.subplots(1, 2)
    ax_tel, ax_final = bottom.subplots(1, 2)
    styles = scheme_styles(len(runs))
    steps = max(len(r["loss"]) for r in runs)
    window = max(1, steps // 30)
    _plot_loss(ax_step, ax_bytes, runs, styles, window)
    _plot_telemetry(ax_tel, runs, styles)
    _plot_final(ax_final, runs, styles)
    handles = [Line2D([], [], lw=1.6, ms=5, **style) for style in styles]
    fig.legend(handles, [r["scheme"] for r in runs], loc="outside right upper",
               title="scheme (same style in every panel)", fontsize=9, title_fontsize=10, handlelength=3.2,
               frameon=False)
    title = "byte-level transformer on Python's docs" if _is_lm(runs) else "digits MLP"
    fig.suptitle(f"gradcompress demo: {title}, {workers} workers, {steps} steps", fontsize=14)
    return fig


def plot(runs: list[dict], path: str, workers: int) -> Figure:
    """Write the report of ``runs`` (the demo's ``results.json`` runs) to ``path`` as a PNG; return the Figure."""
    fig = build_figure(runs, workers)
    fig.savefig(path, dpi=110)
    return fig
