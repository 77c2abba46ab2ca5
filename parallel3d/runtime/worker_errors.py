"""A ConfigError or UsageError that ends a torchrun worker: one line, not a traceback per rank.

``zero3d train`` catches these in its worker entry point (parallel3d/job/run.py): rank 0 prints
``zero3d train: error: <message>`` and the ranks that only learned of it stay quiet. A script
of the user's that calls `parallel3d.initialize` under ``torchrun`` has no such entry point, so
a bad ``zero_optimization.stage`` arrived as one full traceback per rank. `initialize` installs
this module's ``sys.excepthook`` when it runs under torchrun (``TORCHELASTIC_RUN_ID`` set): an
uncaught ConfigError or UsageError then ends the worker (exit status 1, as before) with

* rank 0: ``<script>: error: <message>`` (the message names the key, value and rule);
* another rank whose error rank 0 prints too (the errors `parallel3d.runtime.agreement` raises on
  every rank carry a mark): ``rank N stopped: the same ConfigError as rank 0 (printed there)``;
* another rank with an error of its own: ``rank N: <script>: error: <message>``.

(torchrun itself puts ``[rankN]:`` before each line of a worker's output.)

Every other exception is a bug or the user's own and keeps its traceback (the previous hook
prints it), and ``ZERO3D_TRACEBACK=1`` keeps the traceback of these two as well.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType

from parallel3d.errors import ConfigError, UsageError

REPORTED_BY_RANK0 = "_zero3d_reported_by_rank0"
"""The attribute that marks an error rank 0 raises with the same message."""
_HOOK_MARK = "_zero3d_worker_errors"


def reported_by_rank0(error: BaseException) -> BaseException:
    """Mark ``error`` as one that rank 0 raises (and prints) too; returns it."""
    setattr(error, REPORTED_BY_RANK0, True)
    return error


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def _program() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"


def one_line(error: BaseException, rank: int) -> str:
    """What a worker of rank ``rank`` prints for ``error`` instead of its traceback."""
    if rank == 0:
        return f"{_program()}: error: {error}"
    if getattr(error, REPORTED_BY_RANK0, False):
        return f"rank {rank} stopped: the same {type(error).__name__} as rank 0 (printed there)"
    return f"rank {rank}: {_program()}: error: {error}"


def install() -> None:
    """Install the one-line hook under torchrun (once; a no-op elsewhere)."""
    if not under_torchrun() or getattr(sys.excepthook, _HOOK_MARK, False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, (ConfigError, UsageError)) and os.environ.get("ZERO3D_TRACEBACK", "") in ("", "0"):
            print(one_line(error, int(os.environ.get("RANK", "0"))), file=sys.stderr, flush=True)
            return
        previous(kind, error, tb)

    setattr(hook, _HOOK_MARK, True)
    sys.excepthook = hook
