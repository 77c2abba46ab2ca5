"""A Hugging Face safetensors directory, from its headers only: what is stored where.

``scan_directory`` reads ``model.safetensors`` or the shards ``model.safetensors.index.json``
names, and checks what can be checked without reading data (an index naming a missing shard
or a tensor its file lacks, a truncated file, a malformed header). Each problem is one
:class:`CheckpointError` subclass naming the file (``.path``) and the tensor (``.tensor``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

# The dtype codes of the safetensors format that torch can hold.
_DTYPES: dict[str, torch.dtype] = {
    code: getattr(torch, name)
    for code, name in {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
        "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
        "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2": "float8_e5m2",
        "F8_E5M2FNUZ": "float8_e5m2fnuz", "C64": "complex64", "U64": "uint64", "U32": "uint32",
        "U16": "uint16",
    }.items()
    if hasattr(torch, name)
}


class CheckpointError(Exception):
    """A pretrained directory that cannot be read as asked. ``path`` and ``tensor`` say where."""

    def __init__(self, message: str, *, path: Path | str | None = None, tensor: str | None = None) -> None:
        super().__init__(message)
        self.path = Path(path) if path is not None else None
        self.tensor = tensor


class NotAHuggingFaceDirectory(CheckpointError):
    """Neither ``model.safetensors`` nor ``model.safetensors.index.json`` is there."""


class CheckpointFileMissing(CheckpointError):
    """The index names a shard file that is not in the directory."""


class CheckpointCorrupt(CheckpointError):
    """A header or index that cannot be parsed, or tensor data past the end of its file."""


class CheckpointTensorMissing(CheckpointError):
    """The model needs a tensor the checkpoint does not have."""


class CheckpointShapeMismatch(CheckpointError):
    """A stored tensor whose shape is not the model's."""


class CheckpointDtypeError(CheckpointError):
    """A dtype torch cannot hold, or one that differs from the model's and may not be cast."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a safetensors header describes it."""

    key: str
    file: Path
    code: str  # the safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # byte offsets inside the file's data section

    @property
    def dtype(self) -> torch.dtype | None:
        return _DTYPES.get(self.code)


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, from its header only; checks offsets against the size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > size - 8:
            raise CheckpointCorrupt(f"{path}: not a safetensors file (bad header length)", path=path)
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CheckpointCorrupt(f"{path}: unreadable safetensors header ({exc})", path=path) from None
    data = size - 8 - n
    out: dict[str, StoredTensor] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointCorrupt(f"{path}: malformed header entry for tensor {key}", path=path, tensor=key) from None
        if not 0 <= begin <= end <= data:
            raise CheckpointCorrupt(
                f"{path}: tensor {key} lies past the end of the file (bytes {begin}..{end} of {data}); "
                "the file is truncated",
                path=path,
                tensor=key,
            )
        dtype = _DTYPES.get(code)
        if dtype is not None and end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointCorrupt(
                f"{path}: tensor {key} holds {end - begin} bytes, its shape {list(shape)} and dtype {code} "
                f"need {math.prod(shape) * dtype.itemsize}",
                path=path,
                tensor=key,
            )
        out[key] = StoredTensor(key, path, code, shape, begin)
    return out


def scan_directory(directory: Path | str) -> tuple[Path, dict[str, StoredTensor]]:
    """``(the file that lists the tensors, {key: StoredTensor})`` of a Hugging Face directory."""
    d = Path(directory)
    if not d.is_dir():
        raise NotAHuggingFaceDirectory(f"pretrained directory {d} does not exist or is not a directory", path=d)
    index = d / SAFE_WEIGHTS_INDEX_NAME
    single = d / SAFE_WEIGHTS_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise CheckpointCorrupt(f"{index}: not a safetensors index (no weight_map object)", path=index) from None
        by_file: dict[str, list[str]] = {}
        for key, fname in weight_map.items():
            by_file.setdefault(fname, []).append(key)
        stored: dict[str, StoredTensor] = {}
        for fname, keys in by_file.items():
            path = d / fname
            if not path.is_file():
                raise CheckpointFileMissing(
                    f"{index} names shard {fname}, which is not in {d} (it holds {keys[0]}"
                    + (f" and {len(keys) - 1} more" if len(keys) > 1 else "")
                    + ")",
                    path=path,
                    tensor=keys[0],
                )
            header = read_header(path)
            for key in keys:
                if key not in header:
                    raise CheckpointTensorMissing(
                        f"{index} says {fname} holds tensor {key}, but that file has no such tensor",
                        path=path,
                        tensor=key,
                    )
                stored[key] = header[key]
        return index, stored
    if single.is_file():
        return single, read_header(single)
    present = sorted(p.name for p in d.iterdir())
    hint = ""
    if any(p.endswith((".bin", ".pt", ".pth", ".ckpt")) for p in present):
        hint = " Pickle checkpoints (.bin/.pt) are not read; convert them to safetensors first."
    raise NotAHuggingFaceDirectory(
        f"{d} is not a Hugging Face safetensors directory: expected {SAFE_WEIGHTS_NAME} or "
        f"{SAFE_WEIGHTS_INDEX_NAME} (found: {', '.join(present[:8]) or 'nothing'}).{hint}",
        path=d,
    )
