"""A checkpoint manifest (``checkpoint.json``) checked whole before a load changes anything.

`checkpoint.load` reads tensors straight into the fp32 masters, then sets the optimizer's
states and options, the LR scheduler, the counters and the RNG from the manifest. A field that
could fail in any of those steps must fail before the first: `check_fields` checks every field
the load uses (types, the RNG states' shape), and `check_for_engine` what depends on the
engine that loads (its optimizer type and loss scaler). Both raise `ConfigError` naming the
field; neither changes anything.

`check_pair` ties the manifest to the tensors' metadata (``dcp.json``): each save draws a
random save id and writes it into both, so a manifest beside another checkpoint's tensors
(step-1 counters with step-2 weights) is refused. Manifests written before the id existed
have none and load unchecked (their ``dcp.json`` has none either); a ``dcp.json`` with an id
beside a manifest without one is refused.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from parallel3d.errors import ConfigError

MANIFEST = "checkpoint.json"
"""The manifest's file name in a checkpoint directory."""
METADATA_FILE = "dcp.json"
"""The tensors' metadata file (parallel3d/checkpoint/storage.py). The two names live here, in a module
that imports no torch, so that finding checkpoints does not load torch.distributed.checkpoint."""
SAVE_ID = "dcp_save_id"
"""The manifest key of the save id that its ``dcp.json`` carries too."""
OPTIMIZER_TYPE = "optimizer_type"
PEFT = "peft"  # adapter name -> its adapter_config.json content, for a PEFT model (parallel3d/build/peft_model.py)
"""The manifest key of the inner optimizer's class name (``AdamW``, ``SGD``)."""
IMPLEMENTATION_OPTIONS = frozenset({"fused", "capturable", "foreach", "differentiable"})
"""Group options of how a step is computed; they may differ between the saving and loading run."""


_SWITCH = ("load it with load_optimizer_states=False (weights only) to switch optimizers; a zero3d train job: "
           "`zero3d export` the checkpoint and start the new run from the export (model.path)")


def new_save_id() -> str:
    return uuid.uuid4().hex


def _bad(path: Path, field: str, what: str) -> ConfigError:
    return ConfigError(f"checkpoint {path}: manifest field {field!r} {what}; the checkpoint.json is damaged or "
                       "was edited (restore it, or load another checkpoint)")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_rng(path: Path, rngs: Any) -> None:
    if not isinstance(rngs, list) or not rngs:
        raise _bad(path, "rng", "must be a non-empty list of every rank's RNG states")
    for rank, state in enumerate(rngs):
        where = f"rng[{rank}]"
        if not isinstance(state, dict):
            raise _bad(path, where, "must be a dict of RNG states")
        for key in ("torch", "python", "numpy"):
            if key not in state:
                raise _bad(path, where, f"has no {key!r} state")
        if not (isinstance(state["torch"], dict) and "__tensor__" in state["torch"]):
            raise _bad(path, f"{where}['torch']", "must be a stored tensor")
        python = state["python"]
        if not (isinstance(python, list) and len(python) == 3 and isinstance(python[1], list)):
            raise _bad(path, f"{where}['python']", "must be [version, internal state, gauss]")
        numpy = state["numpy"]
        if not (isinstance(numpy, list) and len(numpy) == 5 and isinstance(numpy[1], list)):
            raise _bad(path, f"{where}['numpy']", "must be [name, keys, pos, has_gauss, cached]")


def check_fields(doc: dict, path: Path) -> None:
    """Every field a load reads has the type it needs (the format is already checked)."""
    for field in ("global_steps", "global_samples"):
        if not _whole(doc.get(field)):
            raise _bad(path, field, f"must be a whole number >= 0, not {doc.get(field)!r}")
    optimizer = doc.get("optimizer")
    if not isinstance(optimizer, dict):
        raise _bad(path, "optimizer", "must be a dict")
    groups = optimizer.get("param_groups")
    if not (isinstance(groups, list) and all(isinstance(g, dict) for g in groups)):
        raise _bad(path, "optimizer.param_groups", "must be a list of dicts")
    if not isinstance(optimizer.get("loss_scaler"), dict):
        raise _bad(path, "optimizer.loss_scaler", "must be a dict")
    if not _whole(optimizer.get("skipped_steps")):
        raise _bad(path, "optimizer.skipped_steps", f"must be a whole number >= 0, not {optimizer.get('skipped_steps')!r}")
    if doc.get("lr_scheduler") is not None and not isinstance(doc["lr_scheduler"], dict):
        raise _bad(path, "lr_scheduler", "must be a dict or null")
    if doc.get("client_state") is not None and not isinstance(doc["client_state"], dict):
        raise _bad(path, "client_state", "must be a dict or null")
    written = doc.get("written_by")
    if not (isinstance(written, dict) and all(_whole(written.get(k)) for k in ("pp", "dp", "tp"))):
        raise _bad(path, "written_by", "must be a dict with whole numbers pp, dp and tp")
    _check_rng(path, doc.get("rng"))
    for field in (SAVE_ID, OPTIMIZER_TYPE):
        if field in doc and not isinstance(doc[field], str):
            raise _bad(path, field, "must be a string")
    adapters = doc.get(PEFT)
    if PEFT in doc and not (isinstance(adapters, dict) and adapters and all(isinstance(c, dict) for c in adapters.values())):
        raise _bad(path, PEFT, "must be a dict of adapter name -> adapter config")


def check_pair(doc: dict, metadata_save_id: str | None, path: Path) -> None:
    """The manifest and ``dcp.json`` were written by the same save."""
    mine = doc.get(SAVE_ID)
    if mine == metadata_save_id:
        return
    if mine is None:
        raise ConfigError(f"checkpoint {path}: dcp.json belongs to save {metadata_save_id}, but checkpoint.json "
                          "names no save: the two files come from different checkpoints (copy the whole checkpoint "
                          "directory, not single files)")
    raise ConfigError(f"checkpoint {path}: checkpoint.json was written by save {mine} but dcp.json by "
                      f"{metadata_save_id or 'an older save without an id'}: the two files come from different "
                      "checkpoints (copy the whole checkpoint directory, not single files)")


def _options(group: dict) -> set[str]:
    return {k for k in group if k not in IMPLEMENTATION_OPTIONS and k not in ("params", "initial_lr")}


def check_for_engine(doc: dict, path: Path, inner, loss_scaler_state: dict) -> None:
    """The saved optimizer state fits this engine's inner optimizer and loss scaler.

    The types must match (the moments of AdamW mean nothing to SGD, and SGD's momentum buffers
    leave AdamW without its moments). Manifests without a type are checked by their group
    options: options the saved groups have and this optimizer's lack mean another type.
    """
    mine = type(inner).__name__
    saved = doc.get(OPTIMIZER_TYPE)
    if getattr(inner, "holds_no_state", False):
        saved = mine  # an engine without an optimizer: there is nothing to mismatch
    elif saved is not None and saved != mine:
        raise ConfigError(f"checkpoint {path} holds the state of a {saved} optimizer and this engine's optimizer is "
                          f"{mine}: configure {saved} to resume it, or {_SWITCH}")
    pairs = zip(doc["optimizer"]["param_groups"], inner.param_groups) if saved is None else ()
    for i, (group, current) in enumerate(pairs):  # an older manifest, without the type
        foreign = sorted(_options(group) - _options(current))
        if foreign:
            raise ConfigError(f"checkpoint {path}: optimizer param group {i} has options {', '.join(foreign)} that "
                              f"this engine's {mine} lacks: it was written with another optimizer type; configure that "
                              f"type to resume it, or {_SWITCH}")
    scaler = doc["optimizer"]["loss_scaler"]
    missing = [k for k in loss_scaler_state if not isinstance(scaler.get(k), (int, float)) or isinstance(scaler.get(k), bool)]
    if missing:
        raise ConfigError(f"checkpoint {path}: its loss scaler state has no number {', '.join(map(repr, missing))} "
                          "that this engine's loss scaler needs (it was written with another precision: fp16 with a "
                          "dynamic loss scale, or bf16/fp32); load it with load_optimizer_states=False")
