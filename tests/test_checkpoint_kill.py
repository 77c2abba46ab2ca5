"""A SIGKILL at any moment of a save leaves ``latest`` naming a complete, loadable checkpoint.

A child process saves checkpoints back to back (so most of its time is spent inside a save)
and is killed at several moments; after each kill, ``latest`` must name a checkpoint whose
manifest, metadata and every chunk's checksum are whole, and the directory may hold no other
complete-looking tag than those written before.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

CHILD = textwrap.dedent("""
    import sys, torch
    import parallel3d
    from tests.tiny import ds_config, make_model
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama", num_hidden_layers=4), config=ds_config(2, 1, 1))
    ids = torch.arange(16)[None]
    for i in range(1000):
        engine.train_batch(iter([{"input_ids": ids, "labels": ids}]))
        engine.save_checkpoint(sys.argv[1], tag=sys.argv[2] if len(sys.argv) > 2 else None)
        print("saved", engine.global_steps, flush=True)
""")


def _complete(tag_dir: Path) -> None:
    from parallel3d.checkpoint.checkpoint import read_manifest
    from parallel3d.checkpoint.storage import read_chunk, read_metadata

    read_manifest(tag_dir)
    md = read_metadata(tag_dir)
    for fqn, tmd in md.state_dict_metadata.items():
        for chunk in tmd.chunks:
            read_chunk(tag_dir, md, fqn, chunk.offsets)  # raises on a bad checksum


def _run_and_kill(tmp_path: Path, delay: float, *tag: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), *tag], stdout=subprocess.PIPE, text=True,
                             env=env, cwd=Path(__file__).resolve().parents[1])
    try:
        for _ in range(2):  # two saves done: the next one is under way
            line = child.stdout.readline()
            assert line.startswith("saved"), f"child stopped early: {line!r}"
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        child.kill()


@pytest.mark.parametrize("delay", [0.0, 0.13, 0.37])
def test_kill_during_save_keeps_latest_whole(tmp_path, delay):
    _run_and_kill(tmp_path, delay)
    latest = (tmp_path / "latest").read_text()
    assert int(latest.removeprefix("global_step")) >= 2
    _complete(tmp_path / latest)


def test_kill_while_replacing_a_tag_loads_its_new_copy(tmp_path):
    """Saving a tag that exists moves the old copy aside, then renames the new one in: a kill
    between the two renames leaves no ``rolling/``, and loading takes the complete new copy."""
    from parallel3d.checkpoint.checkpoint import resolve_tag

    _run_and_kill(tmp_path, 0.0, "rolling")
    assert resolve_tag(tmp_path, None) == tmp_path / "rolling"
    (tmp_path / "rolling").rename(tmp_path / ".rolling.old")  # the state between the renames
    shutil.copytree(tmp_path / ".rolling.old", tmp_path / ".rolling.tmp", dirs_exist_ok=True)
    path = resolve_tag(tmp_path, None)
    assert path == tmp_path / ".rolling.tmp"
    _complete(path)
    (tmp_path / ".rolling.tmp" / "checkpoint.json").unlink()  # a copy still being written is not taken
    with pytest.raises(Exception, match="checkpoint .*/rolling does not exist"):
        resolve_tag(tmp_path, None)
