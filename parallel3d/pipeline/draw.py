"""Draw pipeline timelines: a PNG Gantt chart, a Chrome trace, or an ASCII grid.

Everything here takes a *timeline*: a list of :class:`~parallel3d.pipeline.simulate.Interval`
``(rank, kind, microbatch, chunk, start, end)``. A simulated one comes from ``simulate``; the
engine records measured ones (start/end in seconds) in the same shape, so one drawing code
serves both. A schedule table (per-rank lists of actions) is accepted too and simulated first.

The Chrome trace is the ``{"traceEvents": [...]}`` JSON of chrome://tracing and Perfetto:
one complete event (``"ph": "X"``) per action, one row (thread) per rank, times in
microseconds (``scale`` converts from the timeline's unit; seconds by default).

matplotlib is optional (``pip install 'zero3d[plot]'``) and imported only by :func:`draw_png`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from parallel3d.errors import ConfigError
from parallel3d.pipeline.actions import Action
from parallel3d.pipeline.simulate import Costs, Interval, simulate

__all__ = ["ascii_grid", "draw_png", "read_chrome_trace", "timeline_of", "to_chrome_trace", "write_chrome_trace"]

COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#C44E52"}


def timeline_of(data: Sequence[Interval] | Sequence[Sequence[Action]], costs: Costs = Costs()) -> list[Interval]:
    """``data`` as a flat list of intervals: a table is simulated (async p2p) with ``costs``."""
    items = list(data)
    if items and all(not isinstance(x, Interval) and all(isinstance(a, Action) for a in x) for x in items):
        return simulate([list(rank) for rank in items], costs).intervals
    return [Interval(*iv) for iv in items]


def _label(iv: Interval, chunks: bool) -> str:
    return f"{iv.kind}{iv.microbatch}" + (f".{iv.chunk}" if chunks else "")


def ascii_grid(data: Sequence[Interval] | Sequence[Sequence[Action]], costs: Costs = Costs(),
               unit: float | None = None) -> str:
    """One line per rank, one cell per ``unit`` of time (default: the shortest action).

    An action shows its label (``F3``; ``F3.1`` for chunk 1 when there are several chunks) in
    its first cell and ``-`` in the cells it still occupies; ``.`` is idle time.
    """
    ivs = timeline_of(data, costs)
    if not ivs:
        return ""
    unit = unit or min(iv.end - iv.start for iv in ivs)
    chunks = any(iv.chunk for iv in ivs)
    width = max(len(_label(iv, chunks)) for iv in ivs) + 1
    ranks = 1 + max(iv.rank for iv in ivs)
    t0 = min(iv.start for iv in ivs)
    n = math.ceil(round((max(iv.end for iv in ivs) - t0) / unit, 6))
    rows = [["." for _ in range(n)] for _ in range(ranks)]
    for iv in ivs:
        first = int(round((iv.start - t0) / unit, 6))
        last = max(first + 1, math.ceil(round((iv.end - t0) / unit, 6)))
        rows[iv.rank][first] = _label(iv, chunks)
        for cell in range(first + 1, last):
            rows[iv.rank][cell] = "-"
    return "\n".join(f"rank {r} | " + "".join(c.ljust(width) for c in row).rstrip() for r, row in enumerate(rows))


def to_chrome_trace(data: Sequence[Interval] | Sequence[Sequence[Action]], *, scale: float = 1e6,
                    costs: Costs = Costs(), metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Chrome-trace dict of a timeline; ``scale`` turns its time unit into microseconds."""
    ivs = timeline_of(data, costs)
    ranks = sorted({iv.rank for iv in ivs})
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "pipeline"}}]
    for r in ranks:
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}})
    for iv in sorted(ivs, key=lambda iv: (iv.rank, iv.start)):
        events.append({
            "name": f"{iv.kind}{iv.microbatch}" + (f".{iv.chunk}" if iv.chunk else ""), "cat": iv.kind, "ph": "X",
            "pid": 0, "tid": iv.rank, "ts": iv.start * scale, "dur": (iv.end - iv.start) * scale,
            "args": {"microbatch": iv.microbatch, "chunk": iv.chunk},
        })
    trace: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if metadata:
        trace["otherData"] = dict(metadata)
    return trace


def write_chrome_trace(data: Sequence[Interval] | Sequence[Sequence[Action]], path: str | os.PathLike, *,
                       scale: float = 1e6, costs: Costs = Costs(), metadata: dict[str, Any] | None = None) -> Path:
    """Write :func:`to_chrome_trace` as JSON to ``path``; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(to_chrome_trace(data, scale=scale, costs=costs, metadata=metadata)))
    return path


def read_chrome_trace(path: str | os.PathLike, *, scale: float = 1e6) -> list[Interval]:
    """The intervals of a trace written by :func:`write_chrome_trace` (or by the engine)."""
    try:
        trace = json.loads(Path(path).read_text())
        return [Interval(e["tid"], e["cat"], e["args"]["microbatch"], e["args"]["chunk"], e["ts"] / scale,
                         (e["ts"] + e["dur"]) / scale)
                for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in COLORS]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read a pipeline Chrome trace from {path}: {exc}") from None


def draw_png(data: Sequence[Interval] | Sequence[Sequence[Action]], path: str | os.PathLike, *,
             title: str | None = None, costs: Costs = Costs(), time_label: str = "time") -> Path:
    """Draw the timeline as a Gantt chart (rank 0 on top) into the PNG ``path``.

    F is blue, B green, W red; chunks after the first are drawn hatched. Each bar carries its
    micro-batch number (and chunk) when it is wide enough to read.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError(
            "drawing a pipeline timeline needs matplotlib: pip install 'zero3d[plot]' (or matplotlib)") from None
    ivs = timeline_of(data, costs)
    ranks = 1 + max((iv.rank for iv in ivs), default=0)
    t0 = min((iv.start for iv in ivs), default=0.0)
    span = max((iv.end for iv in ivs), default=1.0) - t0 or 1.0
    chunks = any(iv.chunk for iv in ivs)
    fig, ax = plt.subplots(figsize=(min(24.0, 4.0 + span / min((iv.end - iv.start for iv in ivs), default=1.0) * 0.35),
                                    1.5 + 0.6 * ranks))
    for iv in ivs:
        ax.barh(iv.rank, iv.end - iv.start, left=iv.start - t0, height=0.8, color=COLORS.get(iv.kind, "#999999"),
                edgecolor="black", linewidth=0.5, hatch="//" if iv.chunk else None)
        if (iv.end - iv.start) / span > 0.012:
            ax.text((iv.start + iv.end) / 2 - t0, iv.rank, str(iv.microbatch) + (f".{iv.chunk}" if chunks else ""),
                    ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel(time_label)
    kinds = [k for k in COLORS if any(iv.kind == k for iv in ivs)]
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in kinds], loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m parallel3d.pipeline.draw``: print schedules as ASCII grids with their simulated
    bubble fraction and peak live activations; optionally write a PNG and a Chrome trace."""
    import argparse

    from parallel3d.pipeline.schedules import SCHEDULES, schedule_table

    ap = argparse.ArgumentParser(prog="python -m parallel3d.pipeline.draw", description=main.__doc__)
    ap.add_argument("schedule", nargs="*", default=list(SCHEDULES), help=f"any of {', '.join(SCHEDULES)} (all)")
    ap.add_argument("-p", "--stages", type=int, default=4)
    ap.add_argument("-m", "--microbatches", type=int, default=8)
    ap.add_argument("-v", "--virtual-stages", type=int, default=2, help="chunks per rank for interleaved_1f1b")
    ap.add_argument("--costs", default="1,1,1", help="F,B,W durations (a full backward costs B+W)")
    ap.add_argument("--png", help="write the (first) schedule's Gantt chart here")
    ap.add_argument("--trace", help="write the (first) schedule's Chrome trace here")
    args = ap.parse_args(argv)
    try:
        costs = Costs(*(float(x) for x in args.costs.split(",")))
        for i, name in enumerate(args.schedule):
            v = args.virtual_stages if name == "interleaved_1f1b" else 1
            table = schedule_table(name, args.stages, args.microbatches, v, costs=costs)
            res = simulate(table, costs)
            print(f"{name} P={args.stages} m={args.microbatches}" + (f" V={v}" if v > 1 else "")
                  + f": bubble {res.bubble_fraction:.4f}, peak live activations per rank {res.peak_live}")
            print(ascii_grid(res.intervals, costs) + "\n")
            if i == 0 and args.png:
                draw_png(res.intervals, args.png, title=f"{name} P={args.stages} m={args.microbatches}")
            if i == 0 and args.trace:
                write_chrome_trace(res.intervals, args.trace)
    except ConfigError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
