"""zero3d plot: a PNG from a synthetic metrics.jsonl; clear errors on bad input."""

from __future__ import annotations

import json
import math

import pytest

from parallel3d.errors import ConfigError
from parallel3d.job.plot import main, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir, steps: int = 60) -> None:
    lines = []
    for s in range(1, steps + 1):
        rec = {"step": s, "loss": 5 * math.exp(-s / 20) + 0.3 * math.sin(s) ** 2 + 1, "lr": 1e-3 * min(1, s / 10)}
        lines.append(json.dumps(rec))
        if s % 10 == 0:
            lines.append(json.dumps({"step": s, "val_loss": 5 * math.exp(-s / 20) + 1.2}))
    lines.append(json.dumps({"summary": True, "tokens_per_s": 1234}))  # not a step record: ignored
    run_dir.joinpath("metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_plot_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    write_metrics(tmp_path)
    assert main([str(tmp_path)]) == 0
    png = tmp_path / "loss.png"
    assert capsys.readouterr().out.strip() == str(png)
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert main([str(tmp_path), "--smooth", "0.9", "--out", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s.png").read_bytes().startswith(PNG_MAGIC)


def test_read_metrics_resume_and_torn_line(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.0}\n{"step": 2, "loss": 2.5, "lr": 0.1}\n{"step": 3, "lo')
    assert read_metrics(f) == {"loss": [(1, 3.0), (2, 2.5)], "lr": [(2, 0.1)]}


@pytest.mark.parametrize("content,msg", [
    (None, "cannot read metrics file"),
    ("", "has no records"),
    ('{"step": 1, "acc": 0.5}\n', "has no records"),
    ('{"step": 1, "loss": 2}\nnot json\n{"step": 2, "loss": 1}\n', "metrics.jsonl:2: not a JSON object"),
    (b"\x81\xd7 garbage \xff" * 30, "metrics.jsonl is not text (byte 0 is not UTF-8)"),
], ids=["missing", "empty", "no loss", "bad line", "binary"])
def test_bad_input(tmp_path, capsys, content, msg):
    if isinstance(content, bytes):
        (tmp_path / "metrics.jsonl").write_bytes(content)
    elif content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zero3d plot: error: ") and msg in err and err.count("\n") == 1
    assert main([str(tmp_path / "missing_run")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--smooth"):
        from parallel3d.job.plot import plot_metrics
        plot_metrics(tmp_path, smooth=1.5)


def test_without_matplotlib(tmp_path, capsys, monkeypatch):
    write_metrics(tmp_path, steps=5)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import fails
    assert main([str(tmp_path)]) == 2
    assert "needs matplotlib: pip install 'zero3d[plot]'" in capsys.readouterr().err


# ---- zero3d plot TRACE.json: a pipeline timeline -------------------------------------------


def write_trace(tmp_path, schedule: str = "1f1b", v: int = 1):
    from parallel3d.pipeline import Costs, schedule_table, simulate
    from parallel3d.pipeline.draw import write_chrome_trace

    costs = Costs(f=0.01, b=0.01, w=0.01)  # seconds, as the engine records
    res = simulate(schedule_table(schedule, 4, 8, v), costs)
    path = write_chrome_trace(res.intervals, tmp_path / f"{schedule}.json",
                              metadata={"schedule": schedule, "num_stages": 4, "virtual_stages": v})
    return path, res


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)])
def test_plot_timeline_writes_png(tmp_path, capsys, schedule, v):
    pytest.importorskip("matplotlib")
    trace, _ = write_trace(tmp_path, schedule, v)
    assert main([str(trace)]) == 0
    png = trace.with_suffix(".png")
    assert capsys.readouterr().out.strip() == str(png)
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert main([str(trace), "--out", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes().startswith(PNG_MAGIC)


def test_plot_timeline_title_and_draw_png_reused(tmp_path, monkeypatch):
    """The Gantt chart is draw.py's draw_png, titled with the schedule and the bubble."""
    import parallel3d.pipeline.draw as draw
    from parallel3d.job.plot import plot_timeline

    trace, res = write_trace(tmp_path, "1f1b")
    calls = []
    monkeypatch.setattr(draw, "draw_png", lambda ivs, path, **kw: calls.append((ivs, path, kw)) or path)
    assert plot_timeline(trace) == trace.with_suffix(".png")
    (ivs, path, kw), = calls
    assert len(ivs) == len(res.intervals) == 4 * 8 * 2
    assert kw["title"].startswith("1f1b: P=4 m=8, span 330.0 ms, bubble 0.273")  # (m+P-1)(F+B+W)
    assert kw["time_label"] == "time (s)"


def test_timeline_stats_match_simulate():
    from parallel3d.pipeline import Costs, Interval, schedule_table, simulate
    from parallel3d.job.plot import timeline_stats

    for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)]:
        res = simulate(schedule_table(name, 4, 8, v), Costs(1, 2, 0.5))
        stats = timeline_stats(res.intervals)
        assert stats.span == pytest.approx(res.makespan)
        assert stats.busy == pytest.approx(res.busy)
        assert stats.bubble_fraction == pytest.approx(res.bubble_fraction)
        assert sum(stats.bubble) / 4 == pytest.approx(res.bubble_fraction)
    # measured timelines need not start at 0: the span runs from the first start
    stats = timeline_stats([Interval(0, "F", 0, 0, 10.0, 11.0), Interval(1, "F", 0, 0, 11.0, 12.0)])
    assert (stats.span, stats.busy, stats.bubble, stats.bubble_fraction) == (2.0, [1.0, 1.0], [0.5, 0.5], 0.5)


@pytest.mark.parametrize("content,msg", [
    (None, "cannot read a pipeline Chrome trace"),
    ("not json", "cannot read a pipeline Chrome trace"),
    ('{"traceEvents": []}', "timeline is empty"),
])
def test_plot_timeline_bad_input(tmp_path, capsys, content, msg):
    trace = tmp_path / "trace.json"
    if content is not None:
        trace.write_text(content)
    assert main([str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zero3d plot: error: ") and msg in err and err.count("\n") == 1
