"""Sharded checkpoints at dp = 2: a resumed run is bit-identical to the uninterrupted one.

Run A trains steps 1-3, saves, and goes on to step 6. Run B builds the model with a different
init seed (so only the checkpoint can give it A's weights), loads, and trains steps 4-6 on the
same micro-batches: its losses and its final params must equal A's exactly (``==`` and
``torch.equal``, not approximately), and the LR schedule, step counters and client state must
come back. Errors on loading are checked by their messages.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed

from tests.tiny import ds_config, make_model, rank_micro_batches, token_batches

DP, GAS, STEPS, SAVE_AT = 2, 2, 6, 3

# lr moves every step: linear warmup over 5 steps (after DeepSpeed's extra first step at min)
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3,
                                            "warmup_num_steps": 5, "warmup_type": "linear"}}


def _config(stage: int, precision: str) -> dict:
    cfg = ds_config(stage, GAS, DP, clip=0.5, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {}))
    cfg["scheduler"] = SCHEDULER
    cfg["bf16"] = {"enabled": precision == "bf16"}
    cfg["checkpoint"] = {"async_save": precision == "fp32-async"}
    return cfg


def _with_scalar_param(model):
    """A learnable 0-dim scale on the final norm's output: its Adam moments are 0-dim like its step."""
    norm = model.model.norm
    norm.register_parameter("scale", torch.nn.Parameter(torch.tensor(1.0)))
    norm.register_forward_hook(lambda module, args, out: out * module.scale)
    return model


def _engine(stage: int, precision: str, seed: int):
    import parallel3d

    model = _with_scalar_param(make_model("llama", seed=seed))
    engine, _, _, sched = parallel3d.initialize(model=model, config=_config(stage, precision))
    return engine, sched


def _counters(engine, sched) -> dict:
    return {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "global_samples": engine.global_samples, "lr": engine.get_lr(),
            "sched": sched.last_batch_iteration}


def resume(stage: int, precision: str, ckpt_dir: str) -> dict:
    """On every rank: the uninterrupted run A and the resumed run B (see the module doc)."""
    rank = torch.distributed.get_rank()
    batches = rank_micro_batches(token_batches(STEPS, GAS, DP), rank)
    first = lambda step: iter(batches[step * GAS :])  # noqa: E731 - micro-batches from `step` on

    engine, sched = _engine(stage, precision, seed=0)
    data = first(0)
    losses_a = [engine.train_batch(data) for _ in range(SAVE_AT)]
    saved = _counters(engine, sched)
    tag = engine.save_checkpoint(ckpt_dir, client_state={"epoch": 7, "note": "hi"})
    crc_after_save = torch.serialization.get_crc32_options()  # a save turns torch.save's zip CRC off, then on
    losses_a += [engine.train_batch(data) for _ in range(SAVE_AT, STEPS)]  # beside a background save
    engine.wait_for_checkpoint()
    latest = Path(ckpt_dir, "latest").read_text()
    params_a, working_a = engine.full_parameters(), {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    final_a = _counters(engine, sched)
    del engine, sched

    engine, sched = _engine(stage, precision, seed=123)
    fresh = engine.full_parameters()
    path, client_state = engine.load_checkpoint(ckpt_dir)
    restored = _counters(engine, sched)
    data = first(SAVE_AT)
    losses_b = [engine.train_batch(data) for _ in range(SAVE_AT, STEPS)]
    params_b, working_b = engine.full_parameters(), {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {
        "tag": tag, "latest": latest, "crc_after_save": crc_after_save, "path": path, "client_state": client_state,
        "saved": saved, "restored": restored, "final_a": final_a, "final_b": _counters(engine, sched),
        "losses_a": losses_a, "losses_b": losses_b,
        "different_init": any(not torch.equal(fresh[n], params_a[n]) for n in fresh),
        "params_equal": {n: torch.equal(params_a[n], params_b[n]) for n in params_a},
        "working_equal": {n: torch.equal(working_a[n], working_b[n]) for n in working_a},
        "working_dtype": str(next(iter(working_b.values())).dtype),
    }


CASES = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (3, "bf16"), (3, "fp32-async")]


@pytest.mark.parametrize("stage,precision", CASES, ids=[f"stage{s}-{p}" for s, p in CASES])
def test_resume_is_bit_identical(dist, tmp_path, stage, precision):
    for rank, r in enumerate(dist.run(DP, resume, stage, precision, str(tmp_path))):
        assert r["tag"] == "global_step3" and r["latest"] == "global_step3"
        assert r["path"] == str(tmp_path / "global_step3")
        assert sorted(os.listdir(tmp_path / "global_step3")) == [
            "__0_0.distcp", "__1_0.distcp", "checkpoint.json", "config.json", "dcp.json"]
        assert r["client_state"] == {"epoch": 7, "note": "hi"} and r["crc_after_save"]
        assert r["different_init"], "run B started from the same weights: the test proves nothing"
        # counters and schedule come back as they were at the save
        assert r["restored"] == r["saved"]
        assert r["saved"]["global_steps"] == SAVE_AT and r["saved"]["micro_steps"] == SAVE_AT * GAS
        assert r["saved"]["lr"] != r["final_a"]["lr"]  # the lr does move after the save
        assert r["final_b"] == r["final_a"]
        # and training goes on bit for bit
        assert r["losses_b"] == r["losses_a"][SAVE_AT:], (rank, r["losses_a"], r["losses_b"])
        assert all(r["params_equal"].values()), [n for n, ok in r["params_equal"].items() if not ok]
        assert all(r["working_equal"].values()), [n for n, ok in r["working_equal"].items() if not ok]
        assert r["working_dtype"] == {"bf16": "torch.bfloat16"}.get(precision, "torch.float32")


def failed_background_save(root: str) -> dict:
    """An async save that cannot be written raises at a step soon after, on every rank at the same step."""
    rank = torch.distributed.get_rank()
    engine, _ = _engine(1, "fp32-async", seed=0)
    data = iter(rank_micro_batches(token_batches(6, GAS, DP), rank))
    engine.train_batch(data)
    if rank == 0:
        Path(root, "a_file").write_text("not a directory")
    torch.distributed.barrier()
    engine.save_checkpoint(f"{root}/a_file")
    for step in range(2, 7):
        try:
            engine.train_batch(data)
            time.sleep(0.2)  # give the writer thread time to fail
        except Exception as exc:  # noqa: BLE001 - the test asserts on type and message
            return {"step": step, "error": f"{type(exc).__name__}: {exc}"}
    return {"step": None, "error": "no error"}


def test_a_failed_background_save_is_raised_at_a_step_on_every_rank(dist, tmp_path):
    results = dist.run(DP, failed_background_save, str(tmp_path))
    assert results[0]["step"] is not None and results[0]["step"] == results[1]["step"], results
    for r in results:
        assert r["error"].startswith("ConfigError: the background save of checkpoint global_step1 failed: "
                                     f"cannot create {tmp_path}/a_file/.global_step1.tmp"), r["error"]


# --- errors on loading ------------------------------------------------------------------------


class NotAWeight:
    """Pickles as a call of os.getpid: code that a weights_only load must refuse to run."""

    def __reduce__(self):
        return (os.getpid, ())


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test asserts on type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def load_errors(root: str) -> dict:
    """On every rank: what saving and loading say for bad tags, client state, files and models."""
    import json

    import parallel3d

    rank = torch.distributed.get_rank()
    engine, _ = _engine(2, "fp32", seed=0)
    engine.train_batch(iter(rank_micro_batches(token_batches(1, GAS, DP), rank)))
    engine.save_checkpoint(f"{root}/ckpt")
    wider, _, _, _ = parallel3d.initialize(model=make_model("llama", hidden_size=48), config=_config(1, "fp32"))
    fewer, _, _, _ = parallel3d.initialize(model=make_model("llama", num_hidden_layers=1), config=_config(1, "fp32"))
    model = _with_scalar_param(make_model("llama"))
    halves = [[p for n, p in model.named_parameters() if "layers" in n],
              [p for n, p in model.named_parameters() if "layers" not in n]]
    grouped, _, _, _ = parallel3d.initialize(model=model, config=_config(1, "fp32"),
                                             model_parameters=[{"params": ps} for ps in halves])
    old = Path(root, "old", "global_step1")
    torch.distributed.barrier()
    if rank == 0:
        old.mkdir(parents=True, exist_ok=True)
        torch.save({"payload": NotAWeight()}, old / "rank0.pt")
        evil = Path(root, "evil", "global_step1")
        evil.mkdir(parents=True, exist_ok=True)
        for f in Path(root, "ckpt", "global_step1").iterdir():
            (evil / f.name).write_bytes(f.read_bytes())
        (evil / "dcp.json").write_bytes(b"\x80\x04crafted pickle")
        Path(root, "a_file").write_text("not a directory")
    torch.distributed.barrier()
    return {
        "other_model": _error(lambda: wider.load_checkpoint(f"{root}/ckpt")),
        "fewer_layers": _error(lambda: fewer.load_checkpoint(f"{root}/ckpt")),
        "other_groups": _error(lambda: grouped.load_checkpoint(f"{root}/ckpt")),
        "missing_dir": _error(lambda: engine.load_checkpoint(f"{root}/nowhere")),
        "missing_tag": _error(lambda: engine.load_checkpoint(f"{root}/ckpt", tag="global_step9")),
        "old_format": _error(lambda: engine.load_checkpoint(f"{root}/old", tag="global_step1")),
        "pickled_metadata": _error(lambda: engine.load_checkpoint(f"{root}/evil", tag="global_step1")),
        "bad_tag": _error(lambda: engine.save_checkpoint(f"{root}/ckpt", tag="../../x")),
        "latest_tag": _error(lambda: engine.save_checkpoint(f"{root}/ckpt", tag="latest")),
        "client_path": _error(lambda: engine.save_checkpoint(f"{root}/ckpt", client_state={"out": Path("/tmp")})),
        "into_a_file": _error(lambda: engine.save_checkpoint(f"{root}/a_file")),
        "still_loadable": json.loads(Path(root, "ckpt", "global_step1", "checkpoint.json").read_text())["global_steps"],
        "after_refusals": engine.load_checkpoint(f"{root}/ckpt")[0],
    }


def test_load_and_save_errors(dist, tmp_path):
    for msg in dist.run(DP, load_errors, str(tmp_path)):
        ckpt = tmp_path / "ckpt" / "global_step1"
        assert re.fullmatch(rf"ConfigError: checkpoint {ckpt} holds \S+ with shape \[\d+, 32\], this model "
                            r"\[\d+, 48\]: it was written for another model", msg["other_model"]), msg["other_model"]
        assert msg["fewer_layers"].startswith(f"ConfigError: checkpoint {ckpt} holds parameters this model lacks "
                                              "(model.layers.1."), msg["fewer_layers"]
        assert msg["other_groups"] == (f"ConfigError: checkpoint {ckpt} was written with 1 optimizer param group(s), "
                                       "this engine has 2: give initialize() the param groups of the run that wrote it")
        assert msg["missing_dir"] == f"ConfigError: no checkpoint in {tmp_path}/nowhere: {tmp_path}/nowhere/latest does not exist"
        assert msg["missing_tag"] == f"ConfigError: checkpoint {tmp_path}/ckpt/global_step9 does not exist"
        assert msg["old_format"].startswith(f"ConfigError: checkpoint {tmp_path}/old/global_step1 was written by "
                                            "Zero3D before mesh-free checkpoints"), msg["old_format"]
        assert msg["pickled_metadata"].startswith(f"ConfigError: {tmp_path}/evil/global_step1/dcp.json is unreadable")
        for key, tag in (("bad_tag", "../../x"), ("latest_tag", "latest")):
            assert msg[key].startswith(f"ConfigError: checkpoint tag {tag!r} is not allowed"), msg[key]
        assert msg["client_path"].startswith("ConfigError: client_state['out'] is a pathlib"), msg["client_path"]
        assert "use None, bool, int, float, str" in msg["client_path"]
        assert msg["into_a_file"].startswith(f"ConfigError: cannot create {tmp_path}/a_file/.global_step1.tmp: "), \
            msg["into_a_file"]  # on every rank: rank 0 could not, and the others do not wait for it
        assert msg["still_loadable"] == 1 and msg["after_refusals"] == str(ckpt)
    assert not (tmp_path / "x").exists() and (tmp_path / "ckpt" / "latest").read_text() == "global_step1"


def _damage(ckpt_dir: str, how: str) -> str:
    """Save, damage rank 1's chunk file on disk, and load: every rank must stop, nothing changed."""
    engine, _ = _engine(2, "fp32", seed=0)
    engine.train_batch(iter(rank_micro_batches(token_batches(1, GAS, DP), torch.distributed.get_rank())))
    tag = engine.save_checkpoint(ckpt_dir)
    before = engine.full_parameters()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        if how.startswith("format1"):
            _as_format_1(Path(ckpt_dir, tag))
        file = Path(ckpt_dir, tag, "__1_0.distcp")
        data = bytearray(file.read_bytes())
        if how == "format1":
            pass
        elif how.endswith("flipped"):
            for i in range(len(data) // 2, len(data) // 2 + 64):
                data[i] ^= 0x5A
            file.write_bytes(bytes(data))
        elif how == "truncated":
            file.write_bytes(bytes(data[: len(data) // 3]))
        else:
            file.unlink()
    torch.distributed.barrier()
    message = _error(lambda: engine.load_checkpoint(ckpt_dir))
    after = engine.full_parameters()
    return message if all(torch.equal(before[n], after[n]) for n in before) else "state changed: " + message


def _as_format_1(tag_dir: Path) -> None:
    """Rewrite a checkpoint's dcp.json as format /1 wrote it: a CRC-32 per chunk."""
    import zlib

    path = tag_dir / "dcp.json"
    doc = json.loads(path.read_text())
    doc["format"] = "zero3d-dcp-json/1"
    for tensor in doc["tensors"].values():
        for c in tensor["chunks"]:
            with open(tag_dir / c["file"], "rb") as f:
                f.seek(c["offset"])
                c["crc32"] = zlib.crc32(f.read(c["length"]))
            del c["xxh3_64"]
    path.write_text(json.dumps(doc))


def test_a_format_1_checkpoint_loads(dist, tmp_path):
    assert dist.run(DP, _damage, str(tmp_path), "format1", timeout=120) == ["no error"] * DP


@pytest.mark.parametrize("how", ["flipped", "truncated", "missing", "format1_flipped"])
def test_a_damaged_file_stops_every_rank_before_anything_changes(dist, tmp_path, how):
    for msg in dist.run(DP, _damage, str(tmp_path), how, timeout=120):
        what = {"truncated": "truncated", "missing": "missing"}.get(how, "altered")
        assert msg.startswith(f"CorruptCheckpointError: checkpoint file {tmp_path}/global_step1/__1_0.distcp is "
                              f"damaged ({what})"), msg
