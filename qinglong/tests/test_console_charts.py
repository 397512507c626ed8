"""The overview's SVG bar charts: geometry from counts, no JavaScript involved."""

from __future__ import annotations

import pytest

from qinglong.console.charts import Series, nice_ceiling, stacked_bars


@pytest.mark.parametrize(
    ("value", "ceiling"),
    [
        (0, 1),
        (1, 1),
        (2, 2),
        (3, 5),
        (7, 10),
        (10, 10),
        (11, 20),
        (99, 100),
        (101, 200),
        (4999, 5000),
    ],
)
def test_the_y_axis_ends_at_a_round_number(value, ceiling):
    assert nice_ceiling(value) == ceiling


def test_bars_stack_bottom_up_and_scale_to_the_peak():
    chart = stacked_bars(
        title="t",
        buckets=["a", "b", "c"],
        series=[Series("succeeded", [4, 0, 10]), Series("failed", [1, 0, 0])],
        tick_every=1,
        width=400,
        height=150,
    )
    assert chart.peak == 10
    assert chart.legend == (("succeeded", 14), ("failed", 1))
    assert chart.total == 15
    # Zero counts draw nothing: bucket b has no rectangle at all.
    assert [(r.bucket, r.series, r.count) for r in chart.rects] == [
        ("a", "succeeded", 4),
        ("a", "failed", 1),
        ("c", "succeeded", 10),
    ]
    plot_h = 150 - 8 - 22
    a_ok, a_failed, c_ok = chart.rects
    # Heights are proportional to the counts; the peak bucket fills the plot.
    assert float(c_ok.height) == pytest.approx(plot_h)
    assert float(a_ok.height) == pytest.approx(plot_h * 4 / 10, abs=0.1)
    # The failed part sits on top of the succeeded part of the same bar.
    assert float(a_failed.y) + float(a_failed.height) == pytest.approx(float(a_ok.y), abs=0.1)
    assert float(a_ok.y) + float(a_ok.height) == pytest.approx(float(chart.baseline), abs=0.1)
    assert a_ok.x == a_failed.x
    assert float(c_ok.x) > float(a_ok.x)


def test_ticks_label_every_nth_bucket_and_an_empty_chart_has_no_bars():
    chart = stacked_bars(
        title="t",
        buckets=[f"{h:02}:00" for h in range(24)],
        series=[Series("x", [0] * 24)],
        tick_every=6,
    )
    assert [t.label for t in chart.ticks] == ["00:00", "06:00", "12:00", "18:00"]
    assert chart.rects == ()
    assert chart.peak == 1
    assert chart.total == 0


def test_a_series_must_have_one_count_per_bucket():
    with pytest.raises(ValueError, match="series x"):
        stacked_bars(title="t", buckets=["a", "b"], series=[Series("x", [1])], tick_every=1)
