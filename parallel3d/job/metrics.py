"""Progress and metrics of a run (rank 0): tqdm bar, ``metrics.jsonl``, TensorBoard, summary.

``output_dir/metrics.jsonl`` has one JSON object per line:
  * ``{"step": 0, "val_loss": ...}``: validation before the first step (fresh runs only);
  * per optimizer step: ``step, loss, lr, tokens_per_s, s_per_step, tokens`` (cumulative),
    ``epoch`` (fractional), ``memory_mib`` (model state on rank 0), and ``val_loss`` on
    steps that evaluated.
A resumed run keeps the lines up to the checkpoint's step and appends after them, so the file
reads like one uninterrupted run. TensorBoard event files go to ``output_dir/tensorboard``
when ``torch.utils.tensorboard`` imports (the ``tensorboard`` package is installed).
"""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
from pathlib import Path

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


class TqdmHandler(logging.Handler):
    """A logging handler that prints above the progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def _tensorboard(log_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(log_dir))


def peak_rss_mib() -> float:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 1024 if sys.platform != "darwin" else kib / 2**20


class Metrics:
    """Writes what the trainer reports; a no-op on ranks other than 0."""

    def __init__(self, output_dir: str | Path, active: bool, total_steps: int, start_step: int, progress: bool) -> None:
        self.active = active
        self.records: list[dict] = []
        self.path = Path(output_dir) / "metrics.jsonl"
        self.writer = None
        self.bar = None
        if not active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start_step > 0 and self.path.is_file():  # resumed: keep history up to the checkpoint
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if record.get("step", math.inf) <= start_step:
                    self.records.append(record)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        self.file = self.path.open("a")
        self.writer = _tensorboard(self.path.parent / "tensorboard")
        if progress:
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr)

    def log(self, record: dict) -> None:
        self.records.append(record)
        if not self.active:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        step = record["step"]
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)
        if self.bar is not None:
            if "loss" in record:
                post = (f"loss {record['loss']:.4f} lr {record['lr']:.2e} {record['tokens_per_s']:,.0f} tok/s "
                        f"{record['s_per_step']:.2f} s/step mem {record['memory_mib']:.0f}MiB")
                last_val = next((r["val_loss"] for r in reversed(self.records) if "val_loss" in r), None)
                if last_val is not None:
                    post += f" val {last_val:.4f}"
                self.bar.set_postfix_str(post, refresh=False)  # before the count moves: one frame, one step
                self.bar.update(step - self.bar.n)
        elif "val_loss" in record:
            logger.info("step %d: val_loss %.4f", step, record["val_loss"])

    def close(self) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        self.file.close()

    def summary(self, elapsed_s: float, tokens_per_step: int, extra: dict) -> dict:
        """Numbers of the whole run (from the records, so a resumed run covers both parts)."""
        steps = [r for r in self.records if "loss" in r]
        vals = [r for r in self.records if "val_loss" in r]
        out = dict(extra)
        out["steps"] = steps[-1]["step"] if steps else 0
        out["time_s_this_run"] = round(elapsed_s, 2)
        if steps:
            out["first_loss"], out["last_loss"] = steps[0]["loss"], steps[-1]["loss"]
            times = [r["s_per_step"] for r in steps]
            out["mean_s_per_step"] = sum(times) / len(times)
            out["mean_tokens_per_s"] = tokens_per_step / out["mean_s_per_step"]
        if vals:
            best = min(vals, key=lambda r: r["val_loss"])
            out["first_val_loss"], out["last_val_loss"] = vals[0]["val_loss"], vals[-1]["val_loss"]
            out["best_val_loss"], out["best_val_step"] = best["val_loss"], best["step"]
        out["peak_rss_mib_rank0"] = round(peak_rss_mib(), 1)
        return out


def summary_text(s: dict) -> str:
    lines = [f"finished {s['steps']} steps in {s['time_s_this_run']:.1f} s"
             + (f" ({s['mean_s_per_step']:.3f} s/step, {s['mean_tokens_per_s']:,.0f} tokens/s)" if "mean_s_per_step" in s else "")]
    if "first_loss" in s:
        lines.append(f"train loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}")
    if "first_val_loss" in s:
        lines.append(f"val loss {s['first_val_loss']:.4f} -> {s['last_val_loss']:.4f} "
                     f"(best {s['best_val_loss']:.4f} at step {s['best_val_step']})")
    for key in ("checkpoint", "tokenizer", "metrics"):
        if s.get(key):
            lines.append(f"{key}: {s[key]}")
    return "\n  ".join(lines)
