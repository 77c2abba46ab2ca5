"""The progress bar shows the loss of the step it counts (it showed the previous step's)."""

from __future__ import annotations

import io
import re
import sys

from parallel3d.job.metrics import Metrics


def test_each_frame_shows_the_loss_of_its_step(tmp_path, monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    metrics = Metrics(tmp_path, active=True, total_steps=5, start_step=0, progress=True)
    metrics.bar.mininterval, metrics.bar.miniters, metrics.bar.dynamic_miniters = 0, 1, False  # draw every update
    losses = {step: 10.0 - step for step in range(1, 6)}
    for step, loss in losses.items():
        metrics.log({"step": step, "loss": loss, "lr": 1e-3, "tokens_per_s": 100.0, "s_per_step": 0.1,
                     "memory_mib": 1.0})
    metrics.close()
    frames = [f for f in re.split(r"[\r\n]", stream.getvalue()) if "loss" in f]
    shown = {int(m[1]): float(m[2]) for f in frames if (m := re.search(r" (\d)/5 .*loss (\d+\.\d+)", f))}
    assert shown == losses, frames
    for frame in frames:
        step, loss = re.search(r" (\d)/5 .*loss (\d+\.\d+)", frame).groups()
        assert float(loss) == losses[int(step)], frame
