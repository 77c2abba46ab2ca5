"""Zero3D's front door: ``initialize(model, config)`` -> a ZeRO / 3D-parallel training engine.

The names below load on first use (module ``__getattr__``): ``import parallel3d.X`` runs this file,
and the processes that need none of them (``zero3d``'s command line, torchrun's agent, the
planner's and simulator's children) would otherwise each import the engine, torch's distributed
checkpoint and transformers, about 1.5 s of CPU per process.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from parallel3d.errors import ConfigError, UsageError

_LAZY = {
    "GatheredParameters": "parallel3d.compat.gathered",
    "initialize": "parallel3d.initialize",
    **dict.fromkeys(("safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
                     "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state"),
                    "parallel3d.compat.param_access"),
}

__all__ = ["ConfigError", "UsageError", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'parallel3d' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


class _FrontDoor(types.ModuleType):
    """Keeps ``parallel3d.initialize`` the function: importing the submodule of the same name
    (directly, or by unpickling the function) binds the module here, as for any submodule."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "initialize" and isinstance(value, types.ModuleType):
            value = value.initialize
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _FrontDoor
