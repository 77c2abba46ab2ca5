"""What ``zero3d export`` wrote, in a few lines: the directory, each file and its size, the
parameter count (read back from the safetensors headers) and the special token ids that
``generate`` will use."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path


def safetensors_numels(path: Path) -> dict[str, int]:
    """Each tensor's element count, from a safetensors file's header (no tensor data is read)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def human_size(nbytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _token_ids(out: Path) -> str:
    ids = []
    for name in ("generation_config.json", "config.json"):
        if (out / name).is_file():
            data = json.loads((out / name).read_text())
            ids = [f"{key.removesuffix('_token_id')} {data[key]}" for key in ("eos_token_id", "bos_token_id",
                                                                             "pad_token_id") if key in data]
            return f"special tokens ({name}): {', '.join(ids) if ids else 'none set'}"
    if (out / "adapter_config.json").is_file():
        return "a PEFT adapter directory: PeftModel.from_pretrained(base, this directory) loads it"
    return "special tokens: no config.json"


def describe_export(out: Path, source: Path, dtype: str) -> str:
    """The lines ``zero3d export`` prints after writing ``out`` from the checkpoint ``source``."""
    files = sorted(p for p in out.iterdir() if p.is_file())
    numel = sum(sum(safetensors_numels(p).values()) for p in files if p.suffix == ".safetensors")
    weights = [p for p in files if p.suffix == ".safetensors"]
    width = max((len(p.name) for p in files), default=0)
    lines = [f"wrote {out} from {source}:"]
    lines += [f"  {p.name:<{width}}  {human_size(p.stat().st_size):>9}" for p in files]
    lines.append(f"{numel:,} parameters ({dtype}) in {len(weights)} safetensors file{'s' if len(weights) != 1 else ''}, "
                 f"{human_size(sum(p.stat().st_size for p in files))} in all")
    lines.append(_token_ids(out))
    return "\n".join(lines)
