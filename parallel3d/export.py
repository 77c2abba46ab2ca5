"""``zero3d export CKPT OUT``: a sharded training checkpoint -> a Hugging Face model directory.

Why streaming: the point of ZeRO is a model that does not fit in one place, so export must not
rebuild the full fp32 model in memory. Each rank file is opened with
``torch.load(mmap=True, weights_only=True)`` (no pickled code runs, nothing is read until
touched), and the safetensors files are written by hand: their header only needs names, dtypes
and shapes, which the checkpoint's unit layout already gives, so each parameter is then copied
slice by slice from the master shards that hold it straight into the file. Anonymous memory
stays at one chunk; the mapped file pages are dropped every ``map_budget`` bytes by reopening
the rank files, so the resident set stays bounded too.

What is exported: the fp32 master weights of every trainable parameter. Frozen parameters are
not in a ZeRO checkpoint (they have no master); they are reported and ``from_pretrained`` will
initialize them. Tied weights (GPT-2's ``lm_head`` = ``wte``) are stored once, as in the
checkpoint, and ``from_pretrained`` re-ties them from the config.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from parallel3d.errors import ConfigError

logger = logging.getLogger(__name__)

DTYPES = {"fp32": (torch.float32, "F32"), "bf16": (torch.bfloat16, "BF16"), "fp16": (torch.float16, "F16")}
CHUNK = 1 << 22  # elements copied at a time (16 MB of fp32)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The tag directory holding ``rank*.pt`` for a tag dir, a ``latest`` pointer file, a
    ``checkpoints/`` save dir (its newest tag) or a run dir containing ``checkpoints/``."""
    p = Path(path)
    if p.is_file() and p.name == "latest":
        p = p.parent / p.read_text().strip()
    elif p.is_dir() and not any(p.glob("rank*.pt")):
        if (p / "checkpoints" / "latest").is_file():
            p = p / "checkpoints"
        if (p / "latest").is_file():
            p = p / (p / "latest").read_text().strip()
    if not p.exists():
        raise ConfigError(f"checkpoint {path} does not exist" + (f" (resolved to {p})" if str(p) != str(path) else ""))
    if not p.is_dir() or not (p / "rank0.pt").is_file():
        raise ConfigError(f"{p} is not a zero3d checkpoint: expected a directory with rank0.pt, ... "
                          "(written by engine.save_checkpoint), a 'latest' file or a checkpoints/ directory")
    return p


@dataclass(frozen=True)
class Entry:
    """One parameter: where it lies in its unit's flat buffer, and which unit."""

    name: str
    shape: tuple[int, ...]
    unit: int
    offset: int

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


class ShardReader:
    """Lazily opened, memory-mapped rank files; reopened every ``budget`` bytes read so the
    pages they mapped are released (touched mapped pages count in the resident set)."""

    def __init__(self, tag_dir: Path, budget: int) -> None:
        self.tag_dir, self.budget = tag_dir, budget
        self._states: dict[int, dict] = {}
        self._read = 0

    def state(self, rank: int) -> dict:
        if rank not in self._states:
            file = self.tag_dir / f"rank{rank}.pt"
            if not file.is_file():
                raise ConfigError(f"checkpoint {self.tag_dir} has no {file.name}; the layout needs every rank's file")
            try:
                self._states[rank] = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            except Exception as exc:
                raise ConfigError(f"checkpoint file {file} is unreadable: {exc}") from exc
        return self._states[rank]

    def master(self, rank: int, unit: int) -> torch.Tensor:
        try:
            return self.state(rank)["zero"]["masters"][unit]
        except (KeyError, IndexError, TypeError):
            raise ConfigError(f"{self.tag_dir / f'rank{rank}.pt'} has no fp32 master for unit {unit}") from None

    def consumed(self, nbytes: int) -> None:
        self._read += nbytes
        if self._read >= self.budget:
            self.close()

    def close(self) -> None:
        self._states.clear()
        self._read = 0
        gc.collect()


def read_layout(reader: ShardReader) -> tuple[list[Entry], list[dict]]:
    """Parameters in checkpoint order and the unit layout, checked to be the same on every rank."""
    state = reader.state(0)
    if "layout" not in state or "zero" not in state:
        raise ConfigError(f"{reader.tag_dir / 'rank0.pt'} has no 'layout'/'zero' entries; was it written by engine.save_checkpoint?")
    mesh = list(state.get("mesh", [1, 1, 1]))
    if mesh[0] != 1 or mesh[2] != 1:
        raise ConfigError(f"checkpoint mesh pp x dp x tp = {mesh}: export of tensor/pipeline-parallel checkpoints is not supported yet")
    layout = state["layout"]
    for r in range(1, max((u["world"] for u in layout), default=1)):
        other = reader.state(r)["layout"]
        if [(u["names"], u["shapes"], u["world"]) for u in other] != [(u["names"], u["shapes"], u["world"]) for u in layout]:
            raise ConfigError(f"rank{r}.pt and rank0.pt in {reader.tag_dir} describe different units")
    entries = [Entry(n, tuple(s), i, off) for i, u in enumerate(layout)
               for n, s, off in zip(u["names"], u["shapes"], u["offsets"])]
    reader.close()
    return entries, layout


def param_ranges(entry: Entry, unit: dict) -> list[tuple[int, int, int]]:
    """``(rank, lo, hi)``: the pieces of ``entry`` in order, as ranges of each rank's master shard."""
    size, start, end = unit["shard_size"], entry.offset, entry.offset + entry.numel
    ranks = range(start // size, (end - 1) // size + 1) if entry.numel else ()
    return [(r, max(start, r * size) - r * size, min(end, (r + 1) * size) - r * size) for r in ranks]


def plan_shards(entries: list[Entry], itemsize: int, max_shard_bytes: int) -> list[list[Entry]]:
    """Split parameters (in order) into files of at most ``max_shard_bytes`` (one tensor may exceed it)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        nbytes = e.numel * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    return shards


def write_safetensors(path: Path, entries: list[Entry], layout: list[dict], reader: ShardReader, dtype: str) -> int:
    """Write one safetensors file tensor by tensor; returns the bytes of tensor data."""
    torch_dtype, code = DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": code, "shape": list(e.shape), "data_offsets": [offset, offset + e.numel * itemsize]}
        offset += e.numel * itemsize
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for e in entries:
            for rank, lo, hi in param_ranges(e, layout[e.unit]):
                for a in range(lo, hi, CHUNK):  # chunks, so one huge embedding cannot pin its pages
                    piece = reader.master(rank, e.unit)[a : min(hi, a + CHUNK)]
                    f.write(piece.to(torch_dtype).contiguous().view(torch.uint8).numpy().data)
                    reader.consumed(piece.numel() * piece.element_size())
    return offset


def _find_tokenizer(tag_dir: Path, explicit: str | None) -> Path | None:
    if explicit:
        if not Path(explicit).is_dir():
            raise ConfigError(f"--tokenizer {explicit} is not a directory")
        return Path(explicit)
    for run_dir in (tag_dir.parent.parent, tag_dir.parent):  # <run>/checkpoints/<tag> -> <run>/tokenizer
        if (run_dir / "tokenizer").is_dir():
            return run_dir / "tokenizer"
    return None


def _check_against_model(config, names: set[str]) -> None:
    """Warn about parameters the model has that the checkpoint lacks (frozen ones), or extras."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - a custom model class: skip the check, not the export
        logger.warning("could not build %s on the meta device to check names: %s", config.model_type, exc)
        return
    expected = {n for n, _ in model.named_parameters()}  # named_parameters drops tied duplicates
    if missing := sorted(expected - names):
        logger.warning("%d parameters are not in the checkpoint (frozen params have no ZeRO master); "
                       "from_pretrained will initialize them: %s", len(missing), ", ".join(missing[:8]))
    if extra := sorted(names - expected):
        logger.warning("%d checkpoint parameters are unknown to %s: %s", len(extra), type(model).__name__, ", ".join(extra[:8]))


def export_checkpoint(ckpt: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "fp32",
                      tokenizer: str | None = None, max_shard_size: int = 2 << 30,
                      map_budget: int = 64 << 20, overwrite: bool = False) -> Path:
    """Write ``out`` as a ``from_pretrained`` directory from the checkpoint ``ckpt``; returns ``out``.

    Written into a temporary sibling and renamed at the end, so a failed export leaves nothing
    half-written under ``out``.
    """
    from transformers import AutoConfig

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    tag_dir, out = resolve_checkpoint(ckpt), Path(out)
    if not (tag_dir / "config.json").is_file():
        raise ConfigError(f"checkpoint {tag_dir} has no config.json (the Hugging Face model config); "
                          "was the engine's model a transformers model?")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"output directory {out} is not empty (pass --overwrite to replace it)")
    try:
        config = AutoConfig.from_pretrained(tag_dir)
    except Exception as exc:
        raise ConfigError(f"{tag_dir / 'config.json'} is not a valid Hugging Face config: {exc}") from exc
    reader = ShardReader(tag_dir, map_budget)
    entries, layout = read_layout(reader)
    _check_against_model(config, {e.name for e in entries})
    tok = _find_tokenizer(tag_dir, tokenizer)

    tmp = out.parent / f".{out.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        itemsize = torch.empty((), dtype=DTYPES[dtype][0]).element_size()
        shards = plan_shards(entries, itemsize, max_shard_size)
        names = ["model.safetensors"] if len(shards) == 1 else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        total = 0
        for name, shard in zip(names, shards):
            total += write_safetensors(tmp / name, shard, layout, reader, dtype)
            logger.info("wrote %s (%d tensors)", name, len(shard))
        reader.close()
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {e.name: n for n, shard in zip(names, shards) for e in shard}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        config.dtype = DTYPES[dtype][0]
        config.save_pretrained(tmp)
        if tok is not None:
            for f in tok.iterdir():
                if f.is_file() and f.name != "config.json" and not f.name.endswith(WEIGHT_SUFFIXES):
                    shutil.copy2(f, tmp / f.name)
        else:
            logger.info("no tokenizer found next to the checkpoint; pass --tokenizer DIR to include one")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("exported %d tensors (%.1f MB, %s) from %s to %s", len(entries), total / 2**20, dtype, tag_dir, out)
    return out


def _size(text: str) -> int:
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
    t = text.strip().upper()
    try:
        return int(float(t[:-2]) * units[t[-2:]]) if t[-2:] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 500MB or 2GB, got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """``zero3d export``; returns the exit code."""
    p = argparse.ArgumentParser(prog="zero3d export", description="Write a from_pretrained() directory from a zero3d checkpoint.")
    p.add_argument("ckpt", help="checkpoint tag dir, its 'latest' file, a checkpoints/ dir or a run dir")
    p.add_argument("out", help="output directory")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weight dtype (default fp32)")
    p.add_argument("--tokenizer", help="tokenizer directory to copy (default: <run_dir>/tokenizer if present)")
    p.add_argument("--max-shard-size", type=_size, default=2 << 30, help="largest safetensors file (default 2GB)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        export_checkpoint(args.ckpt, args.out, dtype=args.dtype, tokenizer=args.tokenizer,
                          max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    except ConfigError as exc:
        print(f"zero3d export: error: {exc}", file=sys.stderr)
        return 2
    return 0
