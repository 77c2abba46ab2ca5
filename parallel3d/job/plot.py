"""``zero3d plot RUN_DIR | TRACE.json``: draw a run's loss curves, or a pipeline timeline.

``zero3d plot RUN_DIR`` reads ``RUN_DIR/metrics.jsonl`` (one JSON object per line: ``step`` and any of ``loss``,
``val_loss``, ``lr``; other keys and records are ignored) and writes ``RUN_DIR/loss.png``.
A resumed run may log some steps twice (the steps between the last checkpoint and the crash);
the last record of a step wins, since that is the history the final model has.

``zero3d plot TRACE.json`` reads a pipeline Chrome trace (``engine.write_timeline(path)``, or
``parallel3d.pipeline.draw.write_chrome_trace``) and writes ``TRACE.png`` next to it: a Gantt
chart with one row per pp rank, drawn by :func:`parallel3d.pipeline.draw.draw_png`. The title
carries the trace's schedule (from its ``otherData``) and :func:`timeline_stats`' bubble fraction.

matplotlib is an optional dependency (``pip install 'zero3d[plot]'``), imported only here.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from parallel3d.errors import ConfigError
from parallel3d.pipeline.simulate import Interval

logger = logging.getLogger(__name__)

SERIES = ("loss", "val_loss", "lr")


def read_metrics(path: str | os.PathLike) -> dict[str, list[tuple[float, float]]]:
    """``{"loss" | "val_loss" | "lr": [(step, value), ...]}`` sorted by step, last record per step wins."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read metrics file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"metrics file {path} is not text (byte {exc.start} is not UTF-8); zero3d plot reads the "
                          "metrics.jsonl a run writes: one JSON object per line") from None
    points: dict[str, dict[float, float]] = {k: {} for k in SERIES}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == len(lines):  # a run killed mid-write leaves a torn last line
                logger.warning("%s:%d: ignoring an incomplete last line", path, lineno)
                continue
            raise ConfigError(f"{path}:{lineno}: not a JSON object ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), (int, float)):
            continue
        for key in SERIES:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                points[key][record["step"]] = float(value)
    if not points["loss"] and not points["val_loss"]:
        raise ConfigError(f"metrics file {path} has no records with 'step' and 'loss' or 'val_loss' to plot")
    return {k: sorted(v.items()) for k, v in points.items() if v}


def _ema(values: list[float], alpha: float) -> list[float]:
    out, acc = [], values[0]
    for v in values:
        acc = alpha * acc + (1 - alpha) * v
        out.append(acc)
    return out


def plot_metrics(run_dir: str | os.PathLike, out: str | os.PathLike | None = None, smooth: float = 0.0) -> Path:
    """Write the loss curves of ``run_dir`` to ``out`` (default ``run_dir/loss.png``); returns it."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} does not exist")
    if not 0.0 <= smooth < 1.0:
        raise ConfigError(f"--smooth must be in [0, 1), got {smooth}")
    series = read_metrics(run_dir / "metrics.jsonl")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("zero3d plot needs matplotlib: pip install 'zero3d[plot]' (or matplotlib)") from None

    has_lr = "lr" in series
    fig, axes = plt.subplots(2 if has_lr else 1, 1, figsize=(8, 6.5 if has_lr else 4.5), sharex=True,
                             squeeze=False, gridspec_kw={"height_ratios": [3, 1]} if has_lr else None)
    ax = axes[0][0]
    if "loss" in series:
        steps, values = zip(*series["loss"])
        if smooth > 0:
            ax.plot(steps, values, color="tab:blue", alpha=0.3, linewidth=0.8)
            ax.plot(steps, _ema(list(values), smooth), color="tab:blue", label=f"train loss (EMA {smooth})")
        else:
            ax.plot(steps, values, color="tab:blue", label="train loss")
    if "val_loss" in series:
        steps, values = zip(*series["val_loss"])
        ax.plot(steps, values, "o-", color="tab:orange", markersize=4, label="validation loss")
    ax.set_ylabel("loss")
    ax.set_title(run_dir.resolve().name)
    ax.grid(alpha=0.3)
    ax.legend()
    if has_lr:
        lr_ax = axes[1][0]
        steps, values = zip(*series["lr"])
        lr_ax.plot(steps, values, color="tab:green")
        lr_ax.set_ylabel("learning rate")
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        lr_ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    out = Path(out) if out is not None else run_dir / "loss.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    logger.info("wrote %s", out)
    return out


class TimelineStats(NamedTuple):
    """Idle time of a timeline, measured the way ``simulate`` does.

    ``span`` runs from the earliest start to the latest end over all ranks; ``busy[r]`` is
    the summed length of rank r's compute intervals; ``bubble[r] = 1 - busy[r] / span`` and
    ``bubble_fraction = 1 - sum(busy) / (P * span)`` (P = ranks in the timeline).
    """

    span: float
    busy: list[float]
    bubble: list[float]
    bubble_fraction: float


def timeline_stats(intervals: Sequence[Interval]) -> TimelineStats:
    """:class:`TimelineStats` of ``intervals`` (a measured or simulated timeline)."""
    if not intervals:
        raise ConfigError("the pipeline timeline is empty (was pipeline.record_timeline on?)")
    ranks = 1 + max(iv.rank for iv in intervals)
    span = max(iv.end for iv in intervals) - min(iv.start for iv in intervals)
    busy = [0.0] * ranks
    for iv in intervals:
        busy[iv.rank] += iv.end - iv.start
    if span <= 0:
        return TimelineStats(span, busy, [0.0] * ranks, 0.0)
    return TimelineStats(span, busy, [1 - b / span for b in busy], 1 - sum(busy) / (ranks * span))


def plot_timeline(trace: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Draw the Chrome trace ``trace`` as a Gantt chart PNG (default ``trace`` with ``.png``)."""
    from parallel3d.pipeline.draw import draw_png, read_chrome_trace

    trace = Path(trace)
    intervals = read_chrome_trace(trace)
    stats = timeline_stats(intervals)
    try:
        meta = json.loads(trace.read_text()).get("otherData") or {}
    except (ValueError, AttributeError):
        meta = {}
    name = meta.get("schedule", trace.stem) if isinstance(meta, dict) else trace.stem
    ranks = 1 + max(iv.rank for iv in intervals)
    m = 1 + max(iv.microbatch for iv in intervals)
    v = 1 + max(iv.chunk for iv in intervals)
    title = (f"{name}: P={ranks} m={m}" + (f" V={v}" if v > 1 else "")
             + f", span {stats.span * 1e3:.1f} ms, bubble {stats.bubble_fraction:.3f}")
    out = Path(out) if out is not None else trace.with_suffix(".png")
    draw_png(intervals, out, title=title, time_label="time (s)")
    logger.info("wrote %s", out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``zero3d plot``; returns the exit code."""
    p = argparse.ArgumentParser(prog="zero3d plot", description="Plot train/validation loss of a run, or a "
                                "pipeline timeline (Chrome-trace JSON), to a PNG.")
    p.add_argument("run_dir", metavar="RUN_DIR|TRACE.json",
                   help="run directory containing metrics.jsonl, or a pipeline Chrome trace (engine.write_timeline)")
    p.add_argument("--out", help="output PNG (default RUN_DIR/loss.png, or TRACE.png next to the trace)")
    p.add_argument("--smooth", type=float, default=0.0, help="EMA factor in [0, 1) for the train loss (default 0: raw)")
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        if Path(args.run_dir).is_file() or Path(args.run_dir).suffix == ".json":
            out = plot_timeline(args.run_dir, args.out)
        else:
            out = plot_metrics(args.run_dir, args.out, args.smooth)
    except ConfigError as exc:
        print(f"zero3d plot: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":  # python -m parallel3d.job.plot ARGS runs as zero3d does
    sys.exit(main())
