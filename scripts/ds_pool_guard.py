"""A pool task that ends in a BaseException fails its test instead of hanging it.

DeepSpeed's test harness runs each rank's test body in a ``multiprocessing.Pool`` and re-raises
whatever the body raised. pytest's outcomes (``pytest.fail``, ``pytest.raises``' "DID NOT
RAISE") are BaseExceptions, which a pool worker does not catch: the worker dies, the result
never comes, and the test waits for the harness's timeout (660 s a test, then the session
ends). :func:`install` replaces the pool's ``starmapstar`` (the task function of
``starmap_async``, resolved by name in each worker) with one that re-raises such an outcome as
a RuntimeError with the same message, so the pool reports it and the test fails at once.
KeyboardInterrupt and SystemExit pass through unchanged.
"""

from __future__ import annotations

import multiprocessing.pool
from typing import Any

_PASS_THROUGH = (KeyboardInterrupt, SystemExit)


def _reported(task: Any) -> Any:
    def starmapstar(args: Any) -> Any:
        try:
            return task(args)
        except Exception:
            raise
        except _PASS_THROUGH:
            raise
        except BaseException as exc:  # noqa: BLE001 - a pytest outcome: make the pool carry it
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from None

    starmapstar.__module__, starmapstar.__qualname__ = "multiprocessing.pool", "starmapstar"
    starmapstar.reports_base_exceptions = True  # type: ignore[attr-defined]
    return starmapstar


def install() -> None:
    """Wrap ``multiprocessing.pool.starmapstar`` in this process (idempotent)."""
    if not getattr(multiprocessing.pool.starmapstar, "reports_base_exceptions", False):
        multiprocessing.pool.starmapstar = _reported(multiprocessing.pool.starmapstar)
