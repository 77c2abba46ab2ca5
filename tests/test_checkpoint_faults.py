"""Checkpoint file faults (issue 35): a save that runs out of disk says so, names the device's free
space, removes its partial `.<tag>.tmp` and leaves the earlier checkpoints and `latest` as they
were; a pickle payload in a tensor file stops export with the loader's message."""

from __future__ import annotations

import errno
import hashlib
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed

from parallel3d.runtime.worker_errors import REPORTED_BY_RANK0
from tests.test_checkpoint import NotAWeight, _error
from tests.tiny import ds_config, make_model, rank_micro_batches, token_batches


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def save_without_space(root: str, simulate: bool) -> dict:
    import parallel3d
    from parallel3d.checkpoint import storage as checkpoint_storage

    rank = torch.distributed.get_rank()
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=ds_config(2, 1, 2))
    engine.train_batch(iter(rank_micro_batches(token_batches(1, 1, 2), rank)))
    stream, write = checkpoint_storage._ChecksummingStream, checkpoint_storage._ChecksummingStream.write
    if simulate and rank == 1:
        def full(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        stream.write = full  # this worker process serves later tests: restored below
    before = _snapshot(Path(root)) if rank == 0 else None
    torch.distributed.barrier()
    marked = []

    def save() -> None:
        try:
            engine.save_checkpoint(root)
        except Exception as exc:
            marked.append(getattr(exc, REPORTED_BY_RANK0, False))
            raise

    try:
        message = _error(save)
    finally:
        stream.write = write
    torch.distributed.barrier()
    return {"message": message, "unchanged": _snapshot(Path(root)) == before if rank == 0 else True,
            "printed_by_rank_0_only": marked == [True]}


def _earlier_checkpoint(root: Path) -> None:
    (root / "global_step0").mkdir(parents=True)
    (root / "global_step0" / "checkpoint.json").write_text("{}")
    (root / "latest").write_text("global_step0")


def _check(results: list[dict], root: Path) -> None:
    for r in results:
        assert r["message"].startswith(f"ConfigError: saving checkpoint {root / '.global_step1.tmp'} failed on rank "), r
        assert "no space left on device" in r["message"] and " MiB free on the device of " in r["message"], r
        assert r["unchanged"], r  # the partial .global_step1.tmp is gone; global_step0 and latest as they were
        assert r["printed_by_rank_0_only"], r  # every rank raises it: a worker's entry point prints it on rank 0


def test_a_full_disk_is_reported_and_the_partial_save_removed(dist, tmp_path):
    _earlier_checkpoint(tmp_path)
    _check(dist.run(2, save_without_space, str(tmp_path), True), tmp_path)


def test_a_real_full_filesystem(dist, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        _earlier_checkpoint(small)
        _check(dist.run(2, save_without_space, str(small), False), small)
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_a_pickle_payload_in_a_tensor_file_gets_the_loaders_message(dist, tmp_path, capsys):
    """A chunk replaced by a pickled object (its checksum made to match): export stops with one message."""
    import io
    import json

    import xxhash

    from parallel3d.export.export import main as export_main
    from tests.test_export import train_and_save

    dist.run(2, train_and_save, "llama", 1, str(tmp_path / "ckpt"))
    tag = tmp_path / "ckpt" / "global_step3"
    payload = io.BytesIO()
    torch.save({"payload": NotAWeight()}, payload)
    (tag / "evil.distcp").write_bytes(payload.getvalue())
    doc = json.loads((tag / "dcp.json").read_text())
    name = next(n for n in doc["tensors"] if n.startswith("model/"))
    chunk = doc["tensors"][name]["chunks"][0]
    chunk.update(file="evil.distcp", offset=0, length=len(payload.getvalue()),
                 xxh3_64=xxhash.xxh3_64_intdigest(payload.getvalue()))
    (tag / "dcp.json").write_text(json.dumps(doc))
    assert export_main([str(tag), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"zero3d export: error: checkpoint file {tag / 'evil.distcp'}: the chunk of {name} at [0, 0] "
                          "is not a plain tensor") and err.count("\n") == 1, err
    assert ("is not a plain tensor (the weights-only loader refused it: Trying to load unsupported GLOBAL posix.getpid "
            "whose module posix is blocked)") in err and "nothing in it was run" in err
    assert "Traceback" not in err and not (tmp_path / "hf").exists()
    for message in dist.run(2, load_payload, str(tmp_path / "ckpt")):  # the engine's loader says the same
        assert message.startswith(f"CorruptCheckpointError: checkpoint {tag}: a chunk is not a plain tensor (the weights-only "
                                  "loader refused it: Trying to load unsupported GLOBAL posix.getpid whose module "
                                  "posix is blocked)"), message
        assert message.endswith("nothing in it was run") and "\n" not in message and "\x1b" not in message, message


def load_payload(save_dir: str) -> str:
    import parallel3d

    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=ds_config(1, 1, 2))
    return _error(lambda: engine.load_checkpoint(save_dir))


class _Opens:
    def __reduce__(self):
        return (open, ("/nonexistent/zero3d-RAN", "w"))


@pytest.mark.parametrize("payload,reason", [
    (_Opens(), "Unsupported global: GLOBAL io.open was not an allowed global by default"),
    (NotAWeight(), "Trying to load unsupported GLOBAL posix.getpid whose module posix is blocked")])
def test_the_loaders_refusal_in_one_line(payload, reason):
    import io
    import pickle

    from parallel3d.checkpoint.storage import loader_refusal

    data = io.BytesIO()
    torch.save({"payload": payload}, data)
    data.seek(0)
    with pytest.raises(pickle.UnpicklingError) as info:
        torch.load(data, weights_only=True)
    assert loader_refusal(info.value) == reason
