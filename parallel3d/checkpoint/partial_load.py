"""DeepSpeed's ``save_checkpoint`` / ``load_checkpoint`` arguments, handled around parallel3d/checkpoint/checkpoint.py.

``load_checkpoint(load_optimizer_states=False, load_lr_scheduler_states=False,
load_module_only=True)`` keep parts of the engine's state as they were: the optimizer's by not
reading it (``checkpoint.load(optimizer_states=False)``), the scheduler's and the counters by
``KeptState``, which takes them before the load and puts them back after it. Arguments Zero3D does not honour are refused by ``checkpoint_arguments``.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import torch

from parallel3d.errors import ConfigError


def checkpoint_arguments(save_latest: bool = True, load_module_strict: bool = True, custom_load_fn=None) -> None:
    """Refuse the arguments of DeepSpeed's save/load_checkpoint that Zero3D does not honour."""
    if save_latest is not True:
        raise ConfigError("save_checkpoint(save_latest=False) is not supported: a Zero3D save points "
                          "save_dir/latest at the new checkpoint once it is complete (that is what makes it "
                          "atomic); save into another save_dir to keep `latest` where it is")
    if load_module_strict is not True:
        raise ConfigError("load_checkpoint(load_module_strict=False) is not supported: Zero3D loads every "
                          "trained parameter and refuses a checkpoint that lacks one or has extra ones")
    if custom_load_fn is not None:
        raise ConfigError("load_checkpoint(custom_load_fn=...) is not supported: Zero3D checkpoints are read "
                          "through torch.distributed.checkpoint by parameter name")


class KeptState:
    """What a partial ``load_checkpoint`` leaves as it was: taken before the load, put back after.

    ``scheduler``: the LR scheduler's state (``load_lr_scheduler_states=False``); ``training``:
    the step counters and RNG states (``load_module_only=True``).
    """

    def __init__(self, engine, scheduler: bool, training: bool) -> None:
        self.engine = engine
        scheduler_object = engine.lr_scheduler if scheduler else None
        self.scheduler = copy.deepcopy(scheduler_object.state_dict()) if scheduler_object is not None else None
        self.counters = engine.train_state.state_dict() if training else None
        self.rng = _rng_states() if training else None

    def restore(self) -> None:
        engine = self.engine
        if self.scheduler is not None:
            engine.lr_scheduler.load_state_dict(self.scheduler)
        if self.counters is not None:
            engine.load_train_state(self.counters)
            _set_rng_states(self.rng)


def _rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
