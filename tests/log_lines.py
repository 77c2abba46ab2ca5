"""The messages a library logger emits inside a block, on this rank (pytest's caplog does not
reach the dist harness's worker processes)."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator


@contextlib.contextmanager
def log_lines(name: str) -> Iterator[list[str]]:
    """A list that collects every message logged to logger ``name`` while the block runs."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger(name)
    log.addHandler(handler)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
