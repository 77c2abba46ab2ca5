"""``zero3d plot RUN_DIR``: draw the loss (and validation, and learning-rate) curves of a run.

Reads ``RUN_DIR/metrics.jsonl`` (one JSON object per line: ``step`` and any of ``loss``,
``val_loss``, ``lr``; other keys and records are ignored) and writes ``RUN_DIR/loss.png``.
A resumed run may log some steps twice (the steps between the last checkpoint and the crash);
the last record of a step wins, since that is the history the final model has.

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

from parallel3d.errors import ConfigError

logger = logging.getLogger(__name__)

SERIES = ("loss", "val_loss", "lr")


def read_metrics(path: str | os.PathLike) -> dict[str, list[tuple[float, float]]]:
    """``{"loss" | "val_loss" | "lr": [(step, value), ...]}`` sorted by step, last record per step wins."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read metrics file {path}: {exc.strerror or exc}") from None
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


def main(argv: Sequence[str] | None = None) -> int:
    """``zero3d plot``; returns the exit code."""
    p = argparse.ArgumentParser(prog="zero3d plot", description="Plot train/validation loss of a run to a PNG.")
    p.add_argument("run_dir", help="run directory containing metrics.jsonl")
    p.add_argument("--out", help="output PNG (default RUN_DIR/loss.png)")
    p.add_argument("--smooth", type=float, default=0.0, help="EMA factor in [0, 1) for the train loss (default 0: raw)")
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        out = plot_metrics(args.run_dir, args.out, args.smooth)
    except ConfigError as exc:
        print(f"zero3d plot: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0
