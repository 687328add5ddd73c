"""The demo's ``report.png``: layout, labels, one legend outside the axes, distinct styles per scheme."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("matplotlib")

from gradcompress.cli import demo as demo_mod
from gradcompress.cli.demo import DEFAULT_SCHEMES
from gradcompress.cli.report import scheme_styles

STEPS = 60


def synthetic_runs(schemes=DEFAULT_SCHEMES, steps: int = STEPS, lm: bool = False) -> list[dict]:
    """Runs shaped like the demo's ``results.json`` ``runs``: loss, cumulative bytes, telemetry, final metric."""
    runs = []
    for i, scheme in enumerate(schemes):
        per_step = 4e5 / (1 + i)
        runs.append({
            "scheme": scheme,
            "loss": [2.3 * math.exp(-s / (10 + i)) + 0.01 for s in range(steps)],
            "cumulative_bytes": [per_step * (s + 1) for s in range(steps)],
            "monitor_history": None if scheme == "none" else
            [(s, 0.001 * (i + 1) ** 2 * (1 + 0.1 * (s % 3)), 0.9) for s in range(9, steps, 10)],
            "error_feedback": scheme not in ("none", "fp16", "qsgd", "terngrad"),
            "test_accuracy": None if lm else 96.0 + 0.1 * i,
            "val_loss": 1.5 + 0.01 * i if lm else None,
        })
    return runs


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("lm", [False, True])
def test_report_layout(tmp_path, lm):
    runs = synthetic_runs(lm=lm)
    path = tmp_path / "report.png"
    fig = demo_mod.plot(runs, str(path), 4)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    renderer = fig.canvas.get_renderer()

    axes = fig.get_axes()
    assert len(axes) == 4
    for ax in axes:
        assert ax.get_xlabel().strip() and ax.get_ylabel().strip(), ax.get_title()
        assert ax.get_legend() is None, f"legend inside {ax.get_title()!r}"
    step_ax, bytes_ax, telemetry_ax, final_ax = axes
    assert step_ax.get_xlabel() == "step" and "bytes" in bytes_ax.get_xlabel() and bytes_ax.get_xscale() == "log"
    assert any(unit in t.get_text() for t in bytes_ax.get_xticklabels() for unit in ("KB", "MB", "GB"))
    assert "relative error" in telemetry_ax.get_title()
    assert any("delivered" in t.get_text() for t in telemetry_ax.texts)  # the caption
    assert ("validation loss" if lm else "accuracy (%)") in final_ax.get_xlabel()

    assert len(fig.legends) == 1
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == [r["scheme"] for r in runs]
    box = legend.get_window_extent(renderer)
    for ax in axes:
        assert not _overlaps(box, ax.get_tightbbox(renderer)), ax.get_title()
    fig_box = fig.bbox
    assert fig_box.x0 <= box.x0 and box.x1 <= fig_box.x1 and fig_box.y0 <= box.y0 and box.y1 <= fig_box.y1

    styles = [(h.get_color(), h.get_linestyle()) for h in legend.get_lines()]
    assert len(styles) == len(runs) and len(set(styles)) == len(styles), styles
    for ax in (step_ax, bytes_ax):  # the curves wear the legend's styles
        assert [(ln.get_color(), ln.get_linestyle()) for ln in ax.get_lines()] == styles


def test_scheme_styles_stay_distinct_for_40_schemes():
    styles = scheme_styles(40)
    assert len({(s["color"], s["linestyle"]) for s in styles}) == 40
    assert all((a["color"], a["marker"]) != (b["color"], b["marker"]) for a, b in zip(styles, styles[10:]))
