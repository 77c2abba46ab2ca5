"""Mesh-free checkpoints: saved on one pp x dp x tp layout and ZeRO stage, loaded on any other.

A checkpoint directory ``save_dir/<tag>/`` holds

* the tensors, through torch.distributed.checkpoint (parallel3d/checkpoint/storage.py), each
  under a name and in the shape the unmodified model gives it: ``model/<HF name>`` (fp32
  master weights) and ``optim/<state>/<HF name>`` for every tensor the optimizer keeps per
  parameter in the parameter's shape (Adam's moments, SGD's momentum: whatever ``torch.optim``
  stores), ``optim_scalar/<state>/<HF name>`` for its per-parameter scalars (Adam's ``step``;
  kept apart because a 0-dim parameter's moments are 0-dim too);
* ``checkpoint.json``: the rest, as JSON: engine counters, optimizer group options, loss
  scaler, LR scheduler, every rank's RNG state, the user's ``client_state`` and the layout
  that wrote it (for information only). It is written last: a directory without it is not a
  checkpoint;
* ``config.json``: the Hugging Face model config, when the model has one.

Saving writes into ``save_dir/.<tag>.tmp``; rank 0 renames it once every rank has finished
and only then points ``save_dir/latest`` at it, so a kill at any moment leaves ``latest``
naming a complete checkpoint. Loading reads no pickle: JSON, and tensors through
``torch.load(weights_only=True)`` after their checksums were verified.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import random
import re
import shutil
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from parallel3d.runtime.agreement import raise_on_every_rank
from parallel3d.checkpoint.chunks import Chunk, Split, piece_chunks
from parallel3d.checkpoint.manifest import (MANIFEST, OPTIMIZER_TYPE, PEFT, SAVE_ID, check_fields, check_for_engine,
                                            check_pair, new_save_id)
from parallel3d.checkpoint.storage import (DTYPES_BY_NAME, disk_full_text, plan_load, read_metadata, read_planned,
                                           save_chunks, write_json_atomically)
from parallel3d.errors import ConfigError
from parallel3d.build.peft_model import adapter_configs
from parallel3d.tensor_parallel.sharding import make_spec

if TYPE_CHECKING:
    from parallel3d.build.parallel_model import ParallelModel
    from zero import ZeroOptimizer

logger = logging.getLogger(__name__)

FORMAT = "zero3d-checkpoint/3"
ROUTER_BIASES = "router_biases"  # e_score_correction_bias of each router under load_balance_coeff, by name
_FORMAT_2 = "zero3d-checkpoint/2"  # read too: its scalar states were named optim/ (0-dim params had none)
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")


# ---- what a rank holds ------------------------------------------------------------------


@dataclass(frozen=True)
class ParamEntry:
    """How one of this rank's trainable parameters is named in a checkpoint."""

    name: str  # the checkpoint name (for a tied copy: the name its first holder saves it under)
    splits: tuple[Split, ...]  # how this rank's tensor is cut from the whole: tensor parallelism, an expert slice
    save: bool  # False for the second copy of a tied parameter (the first holder writes it)

    def global_shape(self, local_shape) -> tuple[int, ...]:
        shape = list(local_shape)
        for spec, _, _ in self.splits:
            shape[spec.dim] = spec.full_size
        return tuple(shape)


def param_entries(parallel: ParallelModel) -> dict[nn.Parameter, ParamEntry]:
    """This rank's trainable parameters and their checkpoint names."""
    specs = parallel.tp.shard_specs if parallel.tp is not None else {}
    tp_rank, tp = parallel.mesh.local_rank("tp"), parallel.mesh.tp
    ep = parallel.ep
    tied = {t.param: t for t in (parallel.pipe.tied if parallel.pipe is not None else ())}
    out = {}
    for name, p in parallel.named_parameters():
        if not p.requires_grad:
            continue
        spec, save = specs.get(name), True
        if spec is not None and not spec.is_first_replica(tp_rank):
            save = False  # a replicated kv head: its first holder writes it (ZeRO may cut the copies differently)
        if p in tied and not tied[p].first:
            name, save = next(n for n in tied[p].names if n != name), False
        splits: tuple[Split, ...] = ((spec, tp_rank, tp),) if spec is not None else ()
        if ep is not None and name in ep.params:  # this rank's experts: a slice of dim 0 of the stacked weight
            splits = ((make_spec(ep.experts[name], 0, ep.size), ep.rank, ep.size), *splits)
        out[p] = ParamEntry(name, splits, save)
    return out


def _state_index(metadata, manifest: dict) -> dict[str, dict[str, tuple[str, torch.dtype]]]:
    """``{param name: {state key: (checkpoint name, dtype)}}``; a scalar's name starts with ``optim_scalar/``."""
    out: dict[str, dict] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        kind, _, rest = fqn.partition("/")
        key, _, name = rest.partition("/")
        if kind in ("optim", "optim_scalar") and name:
            if manifest["format"] == _FORMAT_2 and kind == "optim" and tuple(md.size) == ():
                kind = "optim_scalar"
            out.setdefault(name, {})[key] = (f"{kind}/{key}/{name}", md.properties.dtype)
    return out


def _pieces(parallel: ParallelModel):
    """``(entry, master piece, chunks_of)`` per piece of this rank; ``chunks_of(name, flat)`` maps a
    1-D tensor laid out like the piece to its chunks of the global tensor ``name``."""
    entries = param_entries(parallel)
    for param, first, master, shape in parallel.zero.piece_params():
        e = entries[param]

        def chunks_of(name: str, flat: torch.Tensor, e=e, first=first, shape=shape) -> list[Chunk]:
            return piece_chunks(name, flat, first, shape, e.global_shape(shape), e.splits)

        yield e, master, chunks_of


def _chunks_to_save(parallel: ParallelModel) -> list[Chunk]:
    """This rank's chunks of masters and optimizer states (each written by one holder: under hybrid
    sharding the first replica, the others holding the same shards)."""
    chunks: list[Chunk] = []
    for (e, master, chunks_of), state in zip(_pieces(parallel), parallel.zero.piece_states(), strict=True):
        if e.save:
            chunks += chunks_of(f"model/{e.name}", master.detach())
            for key, value in state.items():
                chunks += _state_value_chunks(key, value, e, master, chunks_of)
    # made on every rank all the same: a state no checkpoint can hold is refused everywhere alike
    return chunks if parallel.mesh.local_rank("dp_replicate") == 0 else []


def _chunks_to_load(parallel: ParallelModel, metadata, manifest: dict, optimizer_states: bool) -> tuple[list[Chunk], list[dict]]:
    """Chunks that load into the masters in place and into the optimizer states (returned per piece;
    none without ``optimizer_states``)."""
    saved_states = _state_index(metadata, manifest) if optimizer_states else {}
    chunks: list[Chunk] = []
    states = []
    current = parallel.zero.piece_states()
    for (e, master, chunks_of), now in zip(_pieces(parallel), current, strict=True):
        chunks += chunks_of(f"model/{e.name}", master.data)
        state = {}
        for key, (fqn, dtype) in saved_states.get(e.name, {}).items():
            scalar = fqn.startswith("optim_scalar/")
            shape, device = ((), _scalar_device(parallel.zero, master)) if scalar else (master.shape, master.device)
            value = now.get(key)  # a state of the same kind is overwritten in place (no new pages)
            if not (isinstance(value, torch.Tensor) and value.shape == shape and value.dtype == dtype
                    and value.device == device):
                value = torch.empty(shape, dtype=dtype, device=device)  # every element is read below
            chunks += [Chunk(fqn, (), (), (), value)] if scalar else chunks_of(fqn, value)
            state[key] = value
        states.append(state)
    return chunks, states


def _state_value_chunks(key, value, e: ParamEntry, master, chunks_of) -> list[Chunk]:
    if "/" in str(key) or not isinstance(key, str):
        raise ConfigError(f"optimizer state key {key!r} cannot be stored (state keys must be strings without '/')")
    if isinstance(value, torch.Tensor) and value.dim() == 0:  # a piece's own states are 1-D
        return [Chunk(f"optim_scalar/{key}/{e.name}", (), (), (), value.detach())]
    if isinstance(value, torch.Tensor) and value.numel() == master.numel():
        return chunks_of(f"optim/{key}/{e.name}", value.detach().reshape(-1))
    what = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
    raise ConfigError(
        f"optimizer state {key!r} of {e.name} is {what}; a mesh-free checkpoint stores per-parameter states "
        "that are elementwise (the parameter's shape) or scalars, as Adam, AdamW, SGD, Adagrad and RMSprop keep")


def _scalar_device(zero, master: torch.Tensor) -> torch.device:
    """torch.optim keeps scalar states (``step``) on the CPU unless the group is fused or capturable."""
    group = next(g for g in zero.inner.param_groups if any(p is master for p in g["params"]))
    return master.device if group.get("fused") or group.get("capturable") else torch.device("cpu")


# ---- plain values -----------------------------------------------------------------------


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not _TAG.fullmatch(tag) or tag == "latest":
        raise ConfigError(f"checkpoint tag {tag!r} is not allowed: use 1-128 letters, digits, '.', '_', '+' or '-', "
                          "starting with a letter or digit, and not 'latest'")
    return tag


def encode_value(value, where: str):
    """``value`` as JSON-ready data: plain values, lists, str-keyed dicts and tensors."""
    if isinstance(value, np.generic) and isinstance(value.item(), (bool, int, float)):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [encode_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"{where}: key {bad[0]!r} is not a string; checkpoint dicts need string keys")
        return {k: encode_value(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        if str(t.dtype).removeprefix("torch.") not in DTYPES_BY_NAME:
            raise ConfigError(f"{where} is a tensor of dtype {t.dtype}; a checkpoint stores tensors of "
                              f"{', '.join(sorted(DTYPES_BY_NAME))}")
        return {"__tensor__": base64.b64encode(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").decode(),
                "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    raise ConfigError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which a checkpoint cannot "
                      "store; use None, bool, int, float, str, lists, dicts with string keys, or torch tensors")


def decode_value(value):
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            dtype = DTYPES_BY_NAME[value["dtype"]]
            raw = bytearray(base64.b64decode(value["__tensor__"]))
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(value["shape"]).clone()
        return {k: decode_value(v) for k, v in value.items()}
    return value


def _rng_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [name, keys.tolist(), pos, has_gauss, cached]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return encode_value(state, "rng")


def _set_rng_state(state: dict, trial: bool = False) -> None:
    """Set the RNGs from a decoded ``_rng_state``; ``trial``: set fresh generators instead (a check
    that the states apply, changing nothing)."""
    (torch.Generator().set_state if trial else torch.set_rng_state)(state["torch"])
    version, internal, gauss = state["python"]
    (random.Random().setstate if trial else random.setstate)((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    numpy_state = (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
    (np.random.RandomState().set_state if trial else np.random.set_state)(numpy_state)
    if trial:
        return
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---- save / load ------------------------------------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _gather_to_rank0(value, group: dist.ProcessGroup | None = None) -> list | None:
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size() if _rank() == 0 else None
    dist.gather_object(value, out, dst=0, group=group)
    return out


class StagingBuffer:
    """CPU memory a background save copies its chunks into, kept from one save to the next.

    Most of a copy into fresh memory is the first touch of each page, so reusing the pages
    makes every save after the first one cost about a memcpy. The price is that the buffer
    (this rank's share of the checkpoint) stays allocated between saves, as DCP's caching
    stager does.
    """

    _ALIGN = 64

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def stage(self, chunks: list[Chunk]) -> list[Chunk]:
        sizes = [c.view.numel() * c.view.element_size() for c in chunks]
        spans = [-(-n // self._ALIGN) * self._ALIGN for n in sizes]
        if self.buffer.numel() < sum(spans):
            self.buffer = torch.empty(0, dtype=torch.uint8)  # the old one goes before the new one comes
            self.buffer = torch.empty(sum(spans), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        staged, offset = [], 0
        for c, n, span in zip(chunks, sizes, spans):
            view = self.buffer[offset : offset + n].view(c.view.dtype).view(c.view.shape)
            view.copy_(c.view.detach())
            staged.append(replace(c, view=view))
            offset += span
        return staged


def save(engine, save_dir: str | os.PathLike, tag: str | None, client_state: dict,
         group: dist.ProcessGroup | None = None, staging: StagingBuffer | None = None
         ) -> tuple[str, BackgroundSave | None]:
    """Save ``engine``'s state and ``client_state`` (rank 0's is kept); returns the tag written.

    With ``staging`` the save runs in the background: the chunks are first copied into that
    CPU buffer (the only part training waits for) and a thread writes them over ``group`` (a
    process group of its own, so its collectives never interleave with training's) and
    publishes the checkpoint; the thread is returned, and its ``finish()`` waits for it and
    raises its error, if any.
    """
    tag = check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    client = encode_value(client_state, "client_state")
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    parallel = engine.parallel
    mesh, zero = parallel.mesh, parallel.zero
    manifest = {
        "format": FORMAT,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "optimizer": encode_value(zero.extra_state(), "optimizer"),
        OPTIMIZER_TYPE: type(zero.inner).__name__,
        "lr_scheduler": encode_value(scheduler, "lr_scheduler.state_dict()"),
        "client_state": client,
        "written_by": {"pp": mesh.pp, "dp": mesh.dp, "tp": mesh.tp, "dp_shard": mesh.size("dp_shard"),
                       "zero_stage": zero.settings.stage,
                       "train_batch_size": engine.config.train_batch_size},
    }
    if (adapters := adapter_configs(parallel.module)) is not None:
        manifest[PEFT] = adapters  # zero3d export writes a PEFT adapter directory from it
    chunks = _chunks_to_save(parallel)  # refuses unstorable optimizer state before any collective
    hf_config = getattr(parallel.module, "config", None)
    config_json = hf_config.to_json_string() if hasattr(hf_config, "to_json_string") else None
    manifest["rng"] = _gather_to_rank0(_rng_state(), group)
    if getattr(engine, "expert_bias", None) is not None:  # every pipeline stage's routers, by name (load_balance_coeff)
        stages = _gather_to_rank0(engine.expert_bias.state_dict(), group)
        manifest[ROUTER_BIASES] = encode_value({n: b for part in stages or () for n, b in part.items()},
                                               ROUTER_BIASES)
    if staging is None:
        _write(Path(save_dir), tag, chunks, manifest, config_json, group, zip_crc32=False)
        return tag, None
    thread = BackgroundSave(tag, Path(save_dir), tag, staging.stage(chunks), manifest, config_json, group)
    thread.start()
    return tag, thread


class BackgroundSave(threading.Thread):
    """A save's writing half, run beside training; :meth:`finish` waits and raises its error."""

    def __init__(self, tag: str, *write_args) -> None:
        super().__init__(name=f"zero3d-save-{tag}")
        self.tag, self.write_args, self.error = tag, write_args, None

    def run(self) -> None:
        try:
            _write(*self.write_args)
        except BaseException as exc:  # noqa: BLE001 - raised in the training thread by finish()
            self.error = exc

    def finish(self) -> None:
        self.join()
        if self.error is not None:
            raise ConfigError(f"the background save of checkpoint {self.tag} failed: {self.error}") from self.error


def _write(root: Path, tag: str, chunks: list[Chunk], manifest: dict, config_json: str | None,
           group: dist.ProcessGroup | None, zip_crc32: bool = True) -> None:
    """Write the checkpoint into ``.<tag>.tmp`` on every rank; rank 0 then publishes it.
    ``zip_crc32=False`` (a save in the training thread only): see ``save_chunks``."""
    tmp, final = root / f".{tag}.tmp", root / tag
    save_id = new_save_id()  # rank 0's goes into both its dcp.json and its manifest
    manifest = {**manifest, SAVE_ID: save_id}

    def prepare() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    def finish() -> None:
        if config_json is not None:
            (tmp / "config.json").write_text(config_json)
        write_json_atomically(tmp / MANIFEST, manifest)
        _publish(root, tmp, final, tag)

    _on_rank0(prepare, f"cannot create {tmp}", root, group)
    try:
        save_chunks(tmp, chunks, group, zip_crc32=zip_crc32, save_id=save_id)
        _on_rank0(finish, f"cannot publish checkpoint {final}", root, group)
    except ConfigError:
        if _rank() == 0:  # every rank has stopped writing (both steps end in a collective): free the space
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _on_rank0(action, what: str, where: Path, group: dist.ProcessGroup | None) -> None:
    """Run ``action`` on rank 0 and have every rank of ``group`` raise if it failed (instead of
    the others waiting at a barrier for a rank that has given up)."""
    outcome: list = [None]
    if _rank() == 0:
        try:
            action()
        except OSError as exc:
            outcome[0] = f"{what}: {disk_full_text(exc, where) or exc}"
    if dist.is_initialized():
        dist.broadcast_object_list(outcome, src=0, group=group)
    if outcome[0] is not None:
        raise ConfigError(outcome[0])


def _publish(root: Path, tmp: Path, final: Path, tag: str) -> None:
    """Make ``tmp`` the checkpoint ``tag`` and point ``latest`` at it (rank 0, after every rank wrote)."""
    old = root / f".{tag}.old"  # the copy being replaced (left by a kill between the renames, if any)
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)  # from here until the next rename, resolve_tag falls back to tmp
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(tag)
    latest_tmp.replace(root / "latest")


class NoCheckpointYet(ConfigError):
    """``load_dir`` is a directory without a ``latest`` checkpoint (a job's first start)."""


def resolve_tag(load_dir: str | os.PathLike, tag: str | None) -> Path:
    """The checkpoint directory for ``tag`` (or the ``latest`` one), checked to be a complete checkpoint."""
    root = Path(load_dir)
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            missing = NoCheckpointYet if root.is_dir() else ConfigError
            raise missing(f"no checkpoint in {root}: {latest} does not exist")
        tag = latest.read_text().strip()
    path = root / check_tag(tag)
    if not path.is_dir():
        staged = root / f".{tag}.tmp"
        if (staged / MANIFEST).is_file():
            # killed between _publish's two renames while re-saving ``tag``: the staged copy is
            # complete (its manifest is written after every rank's tensors) and the newest
            logger.warning("checkpoint %s is being replaced; loading its complete new copy %s", path, staged)
            return staged
        raise ConfigError(f"checkpoint {path} does not exist")
    return path


def read_manifest(path: Path) -> dict:
    """The checkpoint's ``checkpoint.json``, or a message saying why ``path`` is not a checkpoint."""
    file = path / MANIFEST
    if not file.is_file():
        if any(path.glob("rank*.pt")):
            raise ConfigError(f"checkpoint {path} was written by Zero3D before mesh-free checkpoints (rank*.pt "
                              "files); this version cannot load it. Export it with the Zero3D release that wrote it "
                              "(`zero3d export`) and start from the exported model with `pretrained=`")
        raise ConfigError(f"{path} is not a complete zero3d checkpoint: it has no {MANIFEST}")
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{file} is unreadable: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") not in (FORMAT, _FORMAT_2):
        raise ConfigError(f"{file} is not a zero3d checkpoint manifest of format {FORMAT!r} or {_FORMAT_2!r}")
    check_fields(doc, path)
    return doc


def _decoded(manifest: dict, path: Path) -> dict:
    """The manifest's stored values decoded (optimizer, scheduler, client state, RNG), or a
    ConfigError naming the field that does not decode; nothing is applied yet."""
    out = {}
    for field in ("optimizer", "lr_scheduler", "client_state", "rng"):
        try:
            out[field] = decode_value(manifest[field])
        except (KeyError, TypeError, ValueError, RuntimeError, binascii.Error) as exc:
            raise ConfigError(f"checkpoint {path}: manifest field {field!r} holds a value that does not decode "
                              f"({exc!r}); the checkpoint.json is damaged or was edited") from None
    out[ROUTER_BIASES] = router_biases(manifest, path)
    for rank, state in enumerate(out["rng"]):
        try:
            _set_rng_state(state, trial=True)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise ConfigError(f"checkpoint {path}: manifest field 'rng[{rank}]' is not a valid RNG state ({exc}); "
                              "the checkpoint.json is damaged or was edited") from None
    return out


def router_biases(manifest: dict, path: Path) -> dict[str, torch.Tensor]:
    """The routers' ``e_score_correction_bias`` a checkpoint holds by HF buffer name (``{}`` when saved without
    ``load_balance_coeff``); ConfigError when the field is not ``{name: floating-point tensor}``."""
    try:
        value = decode_value(manifest.get(ROUTER_BIASES, {}))
        if not isinstance(value, dict) or not all(isinstance(t, torch.Tensor) and t.is_floating_point()
                                                  for t in value.values()):
            raise TypeError("not a dict of floating-point tensors")
    except (KeyError, TypeError, ValueError, RuntimeError, binascii.Error) as exc:
        raise ConfigError(f"checkpoint {path}: manifest field {ROUTER_BIASES!r} holds a value that does not decode "
                          f"({exc!r}); the checkpoint.json is damaged or was edited") from None
    return value


def _check_model(parallel: ParallelModel, metadata, path: Path) -> None:
    """Every parameter of this rank is in the checkpoint with its shape (changes nothing)."""
    entries = param_entries(parallel)
    for param, _, _, shape in parallel.zero.piece_params():
        e = entries[param]
        md = metadata.state_dict_metadata.get(f"model/{e.name}")
        if md is None:
            raise ConfigError(f"checkpoint {path} has no parameter {e.name}: it was written for another model")
        if tuple(md.size) != e.global_shape(shape):
            raise ConfigError(f"checkpoint {path} holds {e.name} with shape {list(md.size)}, this model "
                              f"{list(e.global_shape(shape))}: it was written for another model")


def _check_optimizer(zero: ZeroOptimizer, manifest: dict, path: Path) -> None:
    """The checkpoint has as many optimizer param groups as this engine (they are matched by position)."""
    saved = len(manifest["optimizer"]["param_groups"])
    mine = len(zero.param_groups)
    if saved != mine:
        raise ConfigError(f"checkpoint {path} was written with {saved} optimizer param group(s), this engine has "
                          f"{mine}: give initialize() the param groups of the run that wrote it")


def _check_router_biases(engine, biases: dict[str, torch.Tensor], path: Path) -> None:
    """The checkpoint's router biases fit this rank's routers (``load_balance_coeff``; changes nothing)."""
    balancer = getattr(engine, "expert_bias", None)
    mismatch = balancer.state_mismatch(biases) if balancer is not None else None
    if mismatch is not None:
        raise ConfigError(f"checkpoint {path} holds {mismatch}: it was written for a model with another number of "
                          "routed experts; load it into the model it was written for, or leave expert_parallel."
                          "load_balance_coeff out to keep this model's biases (the checkpoint's are then not read)")


def _check_names(parallel: ParallelModel, metadata, path) -> None:
    """Every model tensor of the checkpoint is held by some rank of this engine (one all-reduce)."""
    saved = sorted(fqn[len("model/"):] for fqn in metadata.state_dict_metadata if fqn.startswith("model/"))
    mine = {e.name for e in param_entries(parallel).values()}
    held = torch.tensor([name in mine for name in saved], dtype=torch.int32, device=parallel.mesh.device)
    if dist.is_initialized():
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
    if extra := [name for name, h in zip(saved, held.tolist()) if not h]:
        raise ConfigError(f"checkpoint {path} holds parameters this model lacks ({', '.join(extra[:5])}"
                          f"{', ...' if len(extra) > 5 else ''}): it was written for another model")


def load(engine, load_dir: str | os.PathLike, tag: str | None = None,
         optimizer_states: bool = True) -> tuple[str, dict]:
    """Restore ``engine`` from ``load_dir``, whatever layout wrote it; returns the path and client state.

    Without ``optimizer_states`` the optimizer is left as it is (its states, group options, loss
    scaler and skip count); the states are not read.

    Every rank reads the JSON, checks the model, plans its own reads and verifies the bytes
    they need; the ranks agree (one all-reduce) before any tensor is read, so a checkpoint
    unfit or damaged on one rank stops all of them with that rank's message and nothing
    changed. A second all-reduce checks that this model holds every saved tensor, and a third
    after the reads makes a failed read stop every rank too.
    """
    parallel, scheduler = engine.parallel, engine.lr_scheduler
    zero, device = parallel.zero, parallel.mesh.device
    error: ConfigError | None = None
    path = manifest = metadata = None
    try:
        path = resolve_tag(load_dir, tag)
        manifest = read_manifest(path)
        metadata = read_metadata(path)
        check_pair(manifest, metadata.storage_meta.save_id if metadata.storage_meta is not None else None, path)
        _check_model(parallel, metadata, path)
        _check_optimizer(zero, manifest, path)
        if optimizer_states:
            check_for_engine(manifest, path, zero.inner, zero.loss_scaler.state_dict())
        values = _decoded(manifest, path)
        _check_router_biases(engine, values[ROUTER_BIASES], path)
        chunks, states = _chunks_to_load(parallel, metadata, manifest, optimizer_states)
        planned = plan_load(path, metadata, chunks)
    except ConfigError as exc:
        error = exc
    raise_on_every_rank(error, device)
    _check_names(parallel, metadata, path)
    error = None
    with torch.no_grad():
        try:
            read_planned(planned)
        except ConfigError as exc:
            error = exc
    raise_on_every_rank(error, device)
    if optimizer_states:
        zero.set_piece_states(states)
        zero.load_extra_state(values["optimizer"])
    zero.publish_params()
    if getattr(engine, "expert_bias", None) is not None:
        engine.expert_bias.load_state_dict(values[ROUTER_BIASES])
    if scheduler is not None and values["lr_scheduler"] is not None:
        scheduler.load_state_dict(values["lr_scheduler"])
    engine.load_train_state({"global_steps": manifest["global_steps"], "global_samples": manifest["global_samples"],
                             "micro_steps": int(manifest["global_steps"]) * engine.gradient_accumulation_steps})
    rngs, mesh = values["rng"], parallel.mesh
    written = manifest["written_by"]
    if [written["pp"], written["dp"], written["tp"]] == [mesh.pp, mesh.dp, mesh.tp] and len(rngs) == mesh.world_size:
        _set_rng_state(rngs[_rank()])
    else:
        logger.info("checkpoint %s was written on another pp x dp x tp layout: RNG states not restored", path)
    return str(path), values["client_state"] or {}
