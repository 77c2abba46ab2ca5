"""Zero3D's local cache (tokenizers trained here, packed datasets): ``$ZERO3D_CACHE`` or ~/.cache/zero3d.

Entries are directories named by a hash of everything they depend on, written under a
temporary name and renamed into place, so concurrent writers and crashes leave either no
entry or a whole one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("ZERO3D_CACHE") or Path.home() / ".cache" / "zero3d")


def key_of(obj) -> str:
    """A short stable hash of a JSON-able description."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cached_dir(kind: str, key: str, build: Callable[[Path], None]) -> Path:
    """``cache_root()/kind/key``, built by ``build(tmp_dir)`` if it is not there yet."""
    final = cache_root() / kind / key
    if final.is_dir():
        return final
    tmp = final.parent / f".{key}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        try:
            tmp.rename(final)
        except OSError:  # another process finished first: keep theirs
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
