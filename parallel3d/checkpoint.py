"""Sharded checkpoints: one file per rank, written atomically, loaded without pickled code.

Layout: ``save_dir/<tag>/rank<R>.pt`` (with the unit layout, so the fp32 weights can be
reassembled without an engine), ``save_dir/<tag>/config.json`` (the HF model config, when
the model has one) and ``save_dir/latest`` naming the newest tag. Each
rank writes into ``save_dir/.<tag>.tmp``; after a barrier rank 0 renames the directory to
its final name and only then updates ``latest``, so a crash mid-save leaves the previous
checkpoint whole. Files hold only tensors and plain Python values and are read with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from parallel3d.errors import ConfigError


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(engine, save_dir: str | os.PathLike, tag: str | None, client_state: dict) -> str:
    """Save ``engine``'s state and ``client_state``; returns the tag written."""
    tag = tag or f"global_step{engine.global_steps}"
    root = Path(save_dir)
    tmp, final = root / f".{tag}.tmp", root / tag
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    state = engine.state_dict_for_checkpoint()
    state["rng"] = _rng_state()
    state["client_state"] = client_state
    torch.save(state, tmp / f"rank{_rank()}.pt")
    hf_config = getattr(engine.module, "config", None)
    if _rank() == 0 and hasattr(hf_config, "to_json_file"):
        hf_config.to_json_file(tmp / "config.json")
    _barrier()
    if _rank() == 0:
        if final.exists():
            old = root / f".{tag}.old"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        latest_tmp = root / ".latest.tmp"
        latest_tmp.write_text(tag)
        latest_tmp.replace(root / "latest")
    _barrier()
    return tag


def resolve_tag(load_dir: str | os.PathLike, tag: str | None) -> Path:
    """The checkpoint directory for ``tag`` (or the ``latest`` one), checked to exist."""
    root = Path(load_dir)
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            raise ConfigError(f"no checkpoint in {root}: {latest} does not exist")
        tag = latest.read_text().strip()
    path = root / tag
    if not path.is_dir():
        raise ConfigError(f"checkpoint {path} does not exist")
    return path


def load(engine, load_dir: str | os.PathLike, tag: str | None = None) -> tuple[str, dict]:
    """Restore ``engine`` from ``load_dir``; returns the checkpoint path and the client state.

    Every rank reads and checks its own file first; the ranks then agree (one all-reduce)
    before any state changes, so a file missing or unfit on one rank stops all of them with
    a message instead of leaving the others waiting in a collective.
    """
    error: ConfigError | None = None
    path = state = None
    try:
        path = resolve_tag(load_dir, tag)
        file = path / f"rank{_rank()}.pt"
        if not file.is_file():
            raise ConfigError(f"checkpoint {path} has no file for rank {_rank()} ({file.name}); was it written by a larger world?")
        try:
            state = torch.load(file, map_location=engine.device, weights_only=True)
        except Exception as exc:
            raise ConfigError(f"checkpoint file {file} is unreadable: {exc}") from exc
        engine.check_checkpoint_state(state)
    except ConfigError as exc:
        error = exc
    if dist.is_initialized():
        failed = torch.tensor([int(error is not None)], device=engine.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() and error is None:
            error = ConfigError(f"checkpoint {path} could not be loaded on another rank (see its error); nothing was changed")
    if error is not None:
        raise error
    engine.load_state_dict_from_checkpoint(state)
    _set_rng_state({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state["rng"].items()})
    return str(path), state.get("client_state", {})
