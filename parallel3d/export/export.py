"""``zero3d export CKPT OUT``: a training checkpoint of any layout -> a Hugging Face model directory.

Why streaming: the point of ZeRO is a model that does not fit in one place, so export must not
rebuild the full fp32 model in memory. A checkpoint stores every parameter under its Hugging
Face name and full shape as chunks (parallel3d/checkpoint/checkpoint.py), whatever pp x dp x tp layout
and ZeRO stage wrote it; the safetensors files are written by hand, since their header only
needs names, dtypes and shapes, so each parameter is assembled from its chunks (checksums
verified) and written before the next is read. Memory stays at the largest tensor plus one
chunk.

A checkpoint of a PEFT model exports as an adapter directory (or merged into its base with
``--merged --base DIR``): parallel3d/export/adapter.py.

What is exported: the fp32 master weights of every trainable parameter. Frozen parameters are
not in a checkpoint (they have no master); they are reported and ``from_pretrained`` will
initialize them. The routers' ``e_score_correction_bias`` buffers that ``load_balance_coeff`` trained
(held in the checkpoint's manifest) are written in float32 under their HF names, as
``save_pretrained`` writes them (``_keep_in_fp32_modules_strict``); one whose number of entries is not that of
the buffer of the model config.json describes is refused before anything is written, as the loader refuses
it. Tied weights (GPT-2's ``lm_head`` = ``wte``) are stored once, as in the
checkpoint, and ``from_pretrained`` re-ties them from the config.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from parallel3d.checkpoint.checkpoint import MANIFEST, check_tag, read_manifest, router_biases
from parallel3d.checkpoint.manifest import PEFT
from parallel3d.checkpoint.storage import read_chunk, read_metadata
from parallel3d.errors import ConfigError
from parallel3d.export.adapter import merge_into_base, remove, scratch_dir, write_adapters
from parallel3d.export.guard import check_output
from parallel3d.build.remote_code import check_remote_code
from parallel3d.export.report import describe_export
from parallel3d.export.tokens import save_model_configs
from parallel3d.expert_parallel.bias_balance import bias_mismatch

logger = logging.getLogger(__name__)

DTYPES = {"fp32": (torch.float32, "F32"), "bf16": (torch.bfloat16, "BF16"), "fp16": (torch.float16, "F16")}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def _latest_tag(latest: Path) -> str:
    tag = latest.read_text(errors="replace").strip()
    if not tag:
        raise ConfigError(f"{latest} is empty; it should name the newest checkpoint directory beside it (such as "
                          "global_step12): write that name into it")
    return check_tag(tag)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The tag directory for a tag dir, a ``latest`` pointer file, a ``checkpoints/`` save dir
    (its newest tag) or a run dir containing ``checkpoints/``."""
    p, named_by = Path(path), None
    if p.is_file() and p.name == "latest":
        p, named_by = p.parent / _latest_tag(p), p
    elif p.is_dir() and not (p / MANIFEST).is_file():
        if (p / "checkpoints" / "latest").is_file():
            p = p / "checkpoints"
        if (p / "latest").is_file():
            p, named_by = p / _latest_tag(p / "latest"), p / "latest"
    if not p.exists():
        raise ConfigError(f"checkpoint {p} does not exist" + (f" ({named_by} names it)" if named_by else ""))
    if not p.is_dir():
        raise ConfigError(f"{p} is not a zero3d checkpoint: expected a checkpoint directory (written by "
                          "engine.save_checkpoint), a 'latest' file or a checkpoints/ directory")
    return p


@dataclass(frozen=True)
class Entry:
    """One tensor of the checkpoint: its HF name and full shape."""

    name: str
    shape: tuple[int, ...]
    key: str = ""  # the name written to the file, when not ``name`` (an adapter file's peft keys)
    value: torch.Tensor | None = field(default=None, compare=False)
    """A router bias from the manifest, written in float32 as it is; None: a parameter assembled from its chunks."""

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    def dtype(self, chosen: str) -> tuple[torch.dtype, str]:
        """The dtype and safetensors code written: ``chosen`` (``--dtype``), float32 for a router bias."""
        return DTYPES["fp32" if self.value is not None else chosen]

    def nbytes(self, chosen: str) -> int:
        return self.numel * torch.empty((), dtype=self.dtype(chosen)[0]).element_size()


def plan_shards(entries: list[Entry], dtype: str, max_shard_bytes: int) -> list[list[Entry]]:
    """Split tensors (in order) into files of at most ``max_shard_bytes`` (one tensor may exceed it)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        nbytes = e.nbytes(dtype)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    return shards


def assemble(tag_dir: Path, metadata, entry: Entry) -> torch.Tensor:
    """The whole fp32 tensor of ``entry`` from its chunks (each checksum verified)."""
    full = torch.empty(entry.shape, dtype=torch.float32)
    covered = 0
    for chunk in metadata.state_dict_metadata[f"model/{entry.name}"].chunks:
        region = full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))]
        region.copy_(read_chunk(tag_dir, metadata, f"model/{entry.name}", chunk.offsets))
        covered += region.numel()
    if covered != full.numel():
        raise ConfigError(f"checkpoint {tag_dir}: the chunks of {entry.name} cover {covered} of its {full.numel()} "
                          "elements; the checkpoint is incomplete")
    return full


def write_safetensors(path: Path, entries: list[Entry], tag_dir: Path, metadata, dtype: str) -> int:
    """Write one safetensors file tensor by tensor; returns the bytes of tensor data."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.key or e.name] = {"dtype": e.dtype(dtype)[1], "shape": list(e.shape),
                                   "data_offsets": [offset, offset + e.nbytes(dtype)]}
        offset += e.nbytes(dtype)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for e in entries:
            whole = assemble(tag_dir, metadata, e) if e.value is None else e.value.reshape(e.shape)
            tensor = whole.to(e.dtype(dtype)[0]).contiguous()
            f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
            del tensor
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


def _meta_model(config, trust_remote_code: bool = False) -> torch.nn.Module | None:
    """The model of ``config`` on the meta device, to check the checkpoint's names and router biases against;
    None (with a warning) for a model class that cannot be built there: the export goes on unchecked."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - a custom model class: skip the check, not the export
        logger.warning("could not build %s on the meta device to check names: %s", config.model_type, exc)
        return None


def _check_router_biases(model: torch.nn.Module | None, biases: dict[str, torch.Tensor], tag_dir: Path) -> None:
    """ConfigError, before anything is written, when a router bias of the checkpoint has another number of
    entries than the buffer of the model its config.json describes (the loader's check, :func:`bias_mismatch`)."""
    if model is None or not biases:
        return
    mismatch = bias_mismatch({n: b.shape for n, b in model.named_buffers() if n in biases}, biases)
    if mismatch is not None:
        raise ConfigError(f"checkpoint {tag_dir} holds {mismatch} (the model of its config.json): its checkpoint.json "
                          "and config.json are of models with another number of routed experts (one of them was "
                          "edited or copied from another checkpoint); export a checkpoint directory as one save "
                          "wrote it")


def _model_order(model: torch.nn.Module | None, names: list[str], buffers: Sequence[str] = ()) -> list[str]:
    """``names`` (parameters, then the ``buffers`` written too) in the order of ``model`` (sorted without one);
    warns of parameters missing (frozen) or of names unknown."""
    if model is None:
        return sorted(names)
    expected = [n for n, _ in model.named_parameters()]  # named_parameters drops tied duplicates
    if missing := [n for n in expected if n not in names]:
        logger.warning("%d parameters are not in the checkpoint (frozen params have no ZeRO master); "
                       "from_pretrained will initialize them: %s", len(missing), ", ".join(missing[:8]))
    expected += [n for n, _ in model.named_buffers() if n in buffers]
    if extra := sorted(set(names) - set(expected)):
        logger.warning("%d checkpoint tensors are unknown to %s: %s", len(extra), type(model).__name__, ", ".join(extra[:8]))
    return [n for n in expected if n in names] + extra


def _write_model(tmp: Path, entries: list[Entry], tag_dir: Path, metadata, dtype: str, max_shard_size: int) -> int:
    """The model's safetensors files (an index when there are several); returns their tensor bytes."""
    shards = plan_shards(entries, dtype, max_shard_size)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = 0
    for name, shard in zip(names, shards):
        total += write_safetensors(tmp / name, shard, tag_dir, metadata, dtype)
        logger.info("wrote %s (%d tensors)", name, len(shard))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {e.name: n for n, shard in zip(names, shards) for e in shard}}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def _export_adapters(tag_dir: Path, metadata, shapes: dict[str, tuple], adapters: dict[str, dict], tmp: Path,
                     dtype: str, max_shard_size: int, trust: bool, base: str | None) -> None:
    """A PEFT checkpoint: its adapter directory under ``tmp``, or with ``base`` the base with the
    adapters merged (parallel3d/export/adapter.py)."""
    def write(path: Path, named: list[tuple[str, str]]) -> None:
        write_safetensors(path, [Entry(n, shapes[n], key) for n, key in named], tag_dir, metadata, dtype)

    if base is None:
        write_adapters(tmp, adapters, list(shapes), write)
        return
    scratch = scratch_dir(tmp)
    try:
        write_adapters(scratch, adapters, list(shapes), write)
        merge_into_base(scratch, base, tmp, DTYPES[dtype][0], max_shard_size, trust)
    finally:
        remove(scratch)


def export_checkpoint(ckpt: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "fp32",
                      tokenizer: str | None = None, max_shard_size: int = 2 << 30,
                      overwrite: bool = False, trust_remote_code: bool = False, merged: bool = False,
                      base: str | None = None) -> Path:
    """Write ``out`` as a ``from_pretrained`` directory from the checkpoint ``ckpt``; returns ``out``.

    A checkpoint of a PEFT model gives a PEFT adapter directory (``PeftModel.from_pretrained(base,
    out)``), or with ``merged`` the ``base`` directory's model with the adapters merged into it.

    Written into a temporary sibling and renamed at the end, so a failed export leaves nothing
    half-written under ``out``.
    """
    from transformers import AutoConfig

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size <= 0:
        raise ConfigError(f"--max-shard-size must be a positive number of bytes, got {max_shard_size!r}")
    tag_dir, out = resolve_checkpoint(ckpt), Path(out)
    if not (tag_dir / "config.json").is_file():
        raise ConfigError(f"checkpoint {tag_dir} has no config.json (the Hugging Face model config); "
                          "was the engine's model a transformers model?")
    check_output(tag_dir, out, overwrite)
    try:
        trust = check_remote_code(tag_dir, trust_remote_code, "--trust-remote-code")
        config = AutoConfig.from_pretrained(tag_dir, trust_remote_code=trust)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{tag_dir / 'config.json'} is not a valid Hugging Face config: {exc}") from exc
    manifest = read_manifest(tag_dir)
    adapters = manifest.get(PEFT)
    biases = router_biases(manifest, tag_dir)
    if biases and adapters is not None:
        logger.warning("%s holds the routers' e_score_correction_bias trained by load_balance_coeff, which an "
                       "adapter export does not write (a PEFT adapter holds no buffers): the model built from it has "
                       "its base's biases", tag_dir)
    if merged and adapters is None:
        raise ConfigError(f"--merged merges PEFT adapters into their base, and {tag_dir} is a checkpoint of a model "
                          "without adapters (its export is the whole model already)")
    if merged and base is None:
        raise ConfigError("--merged needs --base DIR: the checkpoint holds the adapters only, the base weights "
                          "come from the from_pretrained directory the run started from (its model.path)")
    metadata = read_metadata(tag_dir)
    shapes = {fqn[len("model/") :]: tuple(md.size) for fqn, md in metadata.state_dict_metadata.items()
              if fqn.startswith("model/")}
    tok = _find_tokenizer(tag_dir, tokenizer)
    model = _meta_model(config, trust) if adapters is None else None  # an adapter export writes no bias
    _check_router_biases(model, biases, tag_dir)

    tmp = out.parent / f".{out.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if adapters is not None:
            _export_adapters(tag_dir, metadata, shapes, adapters, tmp, dtype, max_shard_size, trust,
                             base if merged else None)
            total = sum(p.stat().st_size for p in tmp.rglob("*.safetensors"))
            entries = list(shapes)
        else:
            tensors = {n: Entry(n, shapes[n]) for n in shapes}
            tensors |= {n: Entry(n, tuple(b.shape), value=b) for n, b in biases.items()}
            entries = [tensors[n] for n in _model_order(model, list(tensors), list(biases))]
            total = _write_model(tmp, entries, tag_dir, metadata, dtype, max_shard_size)
            config.dtype = DTYPES[dtype][0]
            save_model_configs(config, tmp, tag_dir, tok, trust)  # config.json, generation_config.json
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
        size = int(float(t[:-2]) * units[t[-2:]]) if t[-2:] in units else int(t)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected a size like 500MB or 2GB, got {text!r}") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size like 500MB or 2GB, got {text!r}")
    return size


def main(argv: Sequence[str] | None = None) -> int:
    """``zero3d export``; returns the exit code."""
    p = argparse.ArgumentParser(prog="zero3d export", description="Write a from_pretrained() directory from a zero3d checkpoint.")
    p.add_argument("ckpt", help="checkpoint tag dir, its 'latest' file, a checkpoints/ dir or a run dir")
    p.add_argument("out", help="output directory")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weight dtype (default fp32)")
    p.add_argument("--tokenizer", help="tokenizer directory to copy (default: <run_dir>/tokenizer if present)")
    p.add_argument("--max-shard-size", type=_size, default=2 << 30, help="largest safetensors file (default 2GB)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT")
    p.add_argument("--merged", action="store_true",
                   help="a PEFT checkpoint: write the base (--base) with the adapters merged, not the adapter directory")
    p.add_argument("--base", help="with --merged: the from_pretrained directory of the base model the run trained on")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let a checkpoint whose config.json has auto_map run its own Python code (default: refuse it)")
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        out = export_checkpoint(args.ckpt, args.out, dtype=args.dtype, tokenizer=args.tokenizer,
                                max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                                trust_remote_code=args.trust_remote_code, merged=args.merged, base=args.base)
    except ConfigError as exc:
        print(f"zero3d export: error: {exc}", file=sys.stderr)
        return 2
    print(describe_export(out, resolve_checkpoint(args.ckpt), args.dtype))
    return 0


if __name__ == "__main__":  # python -m parallel3d.export.export ARGS runs as zero3d does
    sys.exit(main())
