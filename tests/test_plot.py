"""zero3d plot: a PNG from a synthetic metrics.jsonl; clear errors on bad input."""

from __future__ import annotations

import json
import math

import pytest

from parallel3d.errors import ConfigError
from parallel3d.plot import main, read_metrics

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
])
def test_bad_input(tmp_path, capsys, content, msg):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zero3d plot: error: ") and msg in err and err.count("\n") == 1
    assert main([str(tmp_path / "missing_run")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--smooth"):
        from parallel3d.plot import plot_metrics
        plot_metrics(tmp_path, smooth=1.5)


def test_without_matplotlib(tmp_path, capsys, monkeypatch):
    write_metrics(tmp_path, steps=5)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import fails
    assert main([str(tmp_path)]) == 2
    assert "needs matplotlib: pip install 'zero3d[plot]'" in capsys.readouterr().err
