"""``python -m parallel3d.launch.agent [torchrun arguments]``: torchrun's elastic agent, made to end cleanly.

`zero3d train` and `zero3d launch` start this instead of ``python -m torch.distributed.run``;
it takes the same arguments and runs the same agent in-process, with five differences:

* it dies with its parent (the launcher, or the ssh session that started it): the kernel sends
  it SIGTERM, and torchrun's own handler stops the workers (parallel3d/runtime/lifeline.py);
* its workers learn its pid (``ZERO3D_AGENT_PID``), so each can ask to die with it too;
* each round of an elastic job (restarts, ``--nnodes MIN:MAX``) gets a fresh store;
* a stop signal ends it with exit code 128 + signal and no output: the workers say what
  they did (torchrun prints a traceback and a failure table);
* failed workers end it with the first failure's exit code and one line per failed rank
  (torchrun: exit code 1 and a ~20-line table that says "To enable traceback see ...").

torchrun's own log lines are dropped: they repeat what the workers and these lines say.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence

from parallel3d.runtime.lifeline import AGENT_PID_ENV, PARENT_PID_ENV, die_with_parent, exit_now


def describe_exit(code: int) -> str:
    """``143`` -> "exited with code 143 (stopped by SIGTERM)"; ``-9`` -> "was killed by SIGKILL"."""
    def name(num: int) -> str:
        try:
            return signal.Signals(num).name
        except ValueError:
            return f"signal {num}"

    if code < 0:
        return f"was killed by {name(-code)}"
    if code > 128 and code - 128 in signal.valid_signals():
        return f"exited with code {code} (stopped by {name(code - 128)})"
    return f"exited with code {code}"


def _quiet_torchrun() -> None:
    """Drop torchrun's log records (it logs each signal and every worker's exit; we say it once).

    torch logs through handlers of its own on the ``torch`` and ``torch.distributed`` loggers
    (which do not propagate), so the filter goes on those handlers.
    """
    class NoElastic(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return record.levelno >= logging.CRITICAL or not record.name.startswith("torch.distributed.elastic")

    quiet = NoElastic()
    for name in ("", "torch", "torch.distributed"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(quiet)
    logging.lastResort.addFilter(quiet)


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with ``argv``; returns the exit code (see the module docstring)."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    die_with_parent(int(parent) if parent and parent.isdigit() else os.getppid())
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # the workers inherit this environment
    # Each rendezvous round of an elastic job gets a store of its own (hosted by its rank 0): a
    # restarted round that shares the agent's store reads the dead round's gloo addresses from
    # it and hangs in ProcessGroupGloo's connect (torch 2.13). The static rendezvous ignores it.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    _quiet_torchrun()
    try:
        run(args)
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        first = exc.get_first_failure()[1]
        for rank, failure in sorted(exc.failures.items()):
            print(f"zero3d: worker rank {rank} (pid {failure.pid}) {describe_exit(failure.exitcode)}", file=sys.stderr)
        return first.exitcode if first.exitcode > 0 else 128 - first.exitcode
    except Exception as exc:  # noqa: BLE001 - a rendezvous or start-up failure of the agent itself
        print(f"zero3d: torchrun's agent failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    exit_now(main())
