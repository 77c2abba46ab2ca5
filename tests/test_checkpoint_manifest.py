"""A checkpoint load checks the whole manifest, its tie to dcp.json and the optimizer type before it
changes anything (issue 35): each refusal names the problem, and the engine's weights, optimizer
states, options and counters are unchanged afterwards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed

from tests.tiny import ds_config, make_model, rank_micro_batches, token_batches

DP = 2
SGD = {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}}


def _engine(optimizer: dict | None = None):
    import parallel3d

    cfg = ds_config(2, 1, DP)
    if optimizer is not None:
        cfg["optimizer"] = optimizer
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=cfg)
    return engine


def _train(engine, steps: int, seed: int = 1) -> None:
    for batch in rank_micro_batches(token_batches(steps, 1, DP, seed=seed), torch.distributed.get_rank()):
        engine.train_batch(iter([batch]))


def _state(engine) -> dict:
    """What a load may change: weights, optimizer states and options, counters."""
    zero = engine.optimizer
    return {"params": {k: v.clone() for k, v in engine.full_parameters().items()},
            "states": [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                       for s in zero.piece_states()],
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in zero.param_groups],
            "counters": (engine.global_steps, engine.global_samples, engine.micro_steps, zero.skipped_steps)}


def _same(a: dict, b: dict) -> bool:
    def eq(x, y) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return isinstance(y, (list, tuple)) and len(x) == len(y) and all(eq(u, v) for u, v in zip(x, y))
        return x == y

    return eq(a, b)


def _refusal(engine, root: Path, tag: str) -> str:
    """The message of a refused load, with "UNCHANGED" appended when nothing changed."""
    before = _state(engine)
    try:
        engine.load_checkpoint(str(root), tag=tag)
    except Exception as exc:  # noqa: BLE001 - the test asserts on type and message
        message = f"{type(exc).__name__}: {exc}"
    else:
        message = "no error"
    return message + (" UNCHANGED" if _same(before, _state(engine)) else " CHANGED")


def _edit(root: Path, source: str, tag: str, change) -> None:
    """On rank 0: copy checkpoint ``source`` to ``tag`` and edit its manifest with ``change``."""
    if torch.distributed.get_rank() == 0:
        shutil.copytree(root / source, root / tag)
        doc = json.loads((root / tag / "checkpoint.json").read_text())
        change(doc)
        (root / tag / "checkpoint.json").write_text(json.dumps(doc))


def mixed_and_malformed(root: str) -> dict:
    root = Path(root)
    rank = torch.distributed.get_rank()
    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(str(root))  # global_step1
    _train(engine, 1, seed=2)
    engine.save_checkpoint(str(root))  # global_step2
    sgd = _engine(SGD)
    _train(sgd, 1)
    sgd.save_checkpoint(str(root), tag="sgd")
    if rank == 0:
        for name, manifest_of, tensors_of in (("mix12", "global_step1", "global_step2"),
                                              ("mix21", "global_step2", "global_step1")):
            shutil.copytree(root / tensors_of, root / name)
            shutil.copy(root / manifest_of / "checkpoint.json", root / name / "checkpoint.json")
    _edit(root, "global_step1", "steps_abc", lambda d: d.update(global_steps="abc"))
    _edit(root, "global_step1", "no_rng", lambda d: d.pop("rng"))
    _edit(root, "global_step1", "bad_rng", lambda d: d["rng"][1].update(python=[3, [1, 2], None]))
    _edit(root, "global_step1", "bad_scheduler", lambda d: d.update(lr_scheduler=[1]))
    _edit(root, "global_step1", "bad_skipped", lambda d: d["optimizer"].update(skipped_steps=-1))
    _edit(root, "global_step1", "bad_tensor", lambda d: d["rng"][0]["torch"].update(dtype="complex"))
    _edit(root, "global_step1", "untyped", lambda d: d.pop("optimizer_type"))
    _edit(root, "sgd", "sgd_untyped", lambda d: d.pop("optimizer_type"))
    _edit(root, "global_step1", "no_save_id", lambda d: d.pop("dcp_save_id"))
    torch.distributed.barrier()
    fresh = _engine()
    _train(fresh, 1, seed=5)
    out = {name: _refusal(fresh, root, name) for name in (
        "mix12", "mix21", "steps_abc", "no_rng", "bad_rng", "bad_scheduler", "bad_skipped", "bad_tensor",
        "no_save_id", "sgd", "sgd_untyped")}
    out["adamw_into_sgd"] = _refusal(sgd, root, "global_step1")
    out["untyped_adamw_into_sgd"] = _refusal(sgd, root, "untyped")
    path, _ = fresh.load_checkpoint(str(root), tag="global_step2")  # the refusals left a loadable engine
    out["loaded"] = (Path(path).name, fresh.global_steps)
    sgd.load_checkpoint(str(root), tag="global_step1", load_optimizer_states=False)  # weights only: allowed
    out["weights_only"] = sgd.global_steps
    return out


def test_a_load_checks_the_manifest_its_tensors_and_the_optimizer_before_changing_anything(dist, tmp_path):
    for out in dist.run(DP, mixed_and_malformed, str(tmp_path), timeout=300):
        def ck(tag: str) -> Path:
            return tmp_path / tag

        def damaged(tag: str, field: str, what: str) -> str:
            return (f"ConfigError: checkpoint {ck(tag)}: manifest field {field!r} {what}; the checkpoint.json is "
                    "damaged or was edited (restore it, or load another checkpoint) UNCHANGED")

        for tag in ("mix12", "mix21"):
            assert out[tag].startswith(f"ConfigError: checkpoint {ck(tag)}: checkpoint.json was written by save "), out[tag]
            assert out[tag].endswith("the two files come from different checkpoints (copy the whole checkpoint "
                                     "directory, not single files) UNCHANGED"), out[tag]
        assert out["no_save_id"].startswith(f"ConfigError: checkpoint {ck('no_save_id')}: dcp.json belongs to save ")
        assert out["no_save_id"].endswith("names no save: the two files come from different checkpoints (copy the "
                                          "whole checkpoint directory, not single files) UNCHANGED")
        assert out["steps_abc"] == damaged("steps_abc", "global_steps", "must be a whole number >= 0, not 'abc'")
        assert out["no_rng"] == damaged("no_rng", "rng", "must be a non-empty list of every rank's RNG states")
        assert out["bad_scheduler"] == damaged("bad_scheduler", "lr_scheduler", "must be a dict or null")
        assert out["bad_skipped"] == damaged("bad_skipped", "optimizer.skipped_steps",
                                             "must be a whole number >= 0, not -1")
        assert out["bad_rng"].startswith(f"ConfigError: checkpoint {ck('bad_rng')}: manifest field 'rng[1]' is not a "
                                         "valid RNG state ("), out["bad_rng"]
        assert out["bad_rng"].endswith("the checkpoint.json is damaged or was edited UNCHANGED"), out["bad_rng"]
        assert out["bad_tensor"].startswith(f"ConfigError: checkpoint {ck('bad_tensor')}: manifest field 'rng' holds a "
                                            "value that does not decode ("), out["bad_tensor"]
        assert out["bad_tensor"].endswith("UNCHANGED"), out["bad_tensor"]
        assert out["sgd"] == (f"ConfigError: checkpoint {ck('sgd')} holds the state of a SGD optimizer and this "
                              "engine's optimizer is AdamW: configure SGD to resume it, or load it with "
                              "load_optimizer_states=False (weights only) to switch optimizers; a zero3d train job: `zero3d export` "
                              "the checkpoint and start the new run from the export (model.path) UNCHANGED")
        assert out["adamw_into_sgd"] == (
            f"ConfigError: checkpoint {ck('global_step1')} holds the state of a AdamW optimizer and this engine's "
            "optimizer is SGD: configure AdamW to resume it, or load it with load_optimizer_states=False (weights "
            "only) to switch optimizers; a zero3d train job: `zero3d export` the checkpoint and start the new run "
            "from the export (model.path) UNCHANGED")
        for tag, foreign, mine in (("sgd_untyped", "dampening, momentum, nesterov", "AdamW"),
                                   ("untyped", "amsgrad, betas, ", "SGD")):
            key = tag if tag == "sgd_untyped" else "untyped_adamw_into_sgd"
            assert out[key].startswith(f"ConfigError: checkpoint {ck(tag)}: optimizer param group 0 has options "
                                       f"{foreign}"), out[key]
            assert out[key].endswith(f"that this engine's {mine} lacks: it was written with another optimizer type; "
                                     "configure that type to resume it, or load it with load_optimizer_states=False "
                                     "(weights only) to switch optimizers; a zero3d train job: `zero3d export` the "
                                     "checkpoint and start the new run from the export (model.path) UNCHANGED"), out[key]
        assert out["loaded"] == ("global_step2", 2) and out["weights_only"] == 1
