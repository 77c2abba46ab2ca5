"""A pool task that ends in a pytest outcome reports it instead of hanging the test.

DeepSpeed's test harness runs each rank's test body in a ``multiprocessing.Pool`` and re-raises
whatever the body raised. pytest's outcomes (``pytest.fail``, ``pytest.raises``' "DID NOT
RAISE", ``pytest.xfail``) are BaseExceptions, which a pool worker does not catch: the worker
dies, the result never comes, and the test waits for the harness's timeout (660 s a test, then
the session ends). :func:`install` replaces the pool's ``starmapstar`` (the task function of
``starmap_async``, resolved by name in each worker) with one that carries such an outcome back
as an ordinary exception, so the pool reports it at once:

- ``pytest.xfail(reason)`` becomes :class:`RankXFailed`; the plugin (scripts/ds_unit_plugin.py)
  turns it back into the test's xfail in the pytest process, as if the test had called it there;
- any other outcome (``pytest.fail``, "DID NOT RAISE") becomes a RuntimeError with its message:
  the test fails.

``pytest.skip`` never gets here (DeepSpeed's harness returns its message as the task's result),
and KeyboardInterrupt and SystemExit pass through unchanged.
"""

from __future__ import annotations

import multiprocessing.pool
from typing import Any

_PASS_THROUGH = (KeyboardInterrupt, SystemExit)


class RankXFailed(Exception):
    """A rank called ``pytest.xfail(reason)``; ``args[0]`` is the reason."""


def _is_xfail(exc: BaseException) -> bool:
    from _pytest.outcomes import XFailed

    return isinstance(exc, XFailed)


def _reported(task: Any) -> Any:
    def starmapstar(args: Any) -> Any:
        try:
            return task(args)
        except Exception:
            raise
        except _PASS_THROUGH:
            raise
        except BaseException as exc:  # noqa: BLE001 - a pytest outcome: make the pool carry it
            if _is_xfail(exc):
                raise RankXFailed(getattr(exc, "msg", None) or str(exc)) from None
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from None

    starmapstar.__module__, starmapstar.__qualname__ = "multiprocessing.pool", "starmapstar"
    starmapstar.reports_base_exceptions = True  # type: ignore[attr-defined]
    return starmapstar


def install() -> None:
    """Wrap ``multiprocessing.pool.starmapstar`` in this process (idempotent)."""
    if not getattr(multiprocessing.pool.starmapstar, "reports_base_exceptions", False):
        multiprocessing.pool.starmapstar = _reported(multiprocessing.pool.starmapstar)
