"""What InitReplay replays: a model's construction, and the names it ends with.

A Hugging Face model is rebuilt from its config exactly as ``from_config`` builds it; any
other module is initialized with its modules' ``reset_parameters()``. The errors a meta
model can meet are here too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


class MaterializeError(RuntimeError):
    """A meta model whose values cannot be reproduced."""


class UninitializedTensorError(MaterializeError):
    """Construction never writes these tensors: eager construction leaves them as garbage."""


class NoInitializerError(MaterializeError):
    """A non-Hugging Face module owns parameters but has no ``reset_parameters``."""


class MetaBuildDrewError(MaterializeError):
    """Construction draws random numbers on the CPU even on meta: the seed must be given."""


class ReplayMismatchError(MaterializeError):
    """The meta model is not what its construction builds (modified after construction?)."""


@dataclass(frozen=True)
class TensorEntry:
    """One named tensor of the model, and where its value lives in the trace."""

    name: str
    kind: str  # "parameter" or "buffer"
    persistent: bool
    shape: torch.Size
    dtype: torch.dtype
    sid: int | None  # the traced storage; None for a tensor construction made on the CPU
    stride: tuple[int, ...]
    offset: int


def _is_hf(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(model, PreTrainedModel)


def _hf_program(model: nn.Module) -> Callable[[], nn.Module]:
    cls = type(model)
    config = copy.deepcopy(model.config)
    # ``_from_config`` is what ``AutoModelForCausalLM.from_config`` calls; it reads the dtype
    # back from ``config.dtype``, which the first construction set.
    return lambda: cls._from_config(copy.deepcopy(config))


def _plain_program(model: nn.Module) -> Callable[[], nn.Module]:
    for name, module in model.named_modules():
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if own and not callable(getattr(module, "reset_parameters", None)):
            raise NoInitializerError(
                f"module {name or '<root>'} ({type(module).__name__}) owns parameters {own} but has no "
                "reset_parameters(), so its values cannot be made on the meta device. Give the class a "
                "reset_parameters() that initializes its own parameters, or build the model eagerly (on CPU) "
                "and pass the real model."
            )
    template = copy.deepcopy(model)  # meta: costs nothing

    def run() -> nn.Module:
        m = _fresh_copy(template)
        for module in m.modules():
            if any(True for _ in module.parameters(recurse=False)) or any(
                True for _ in module.buffers(recurse=False)
            ):
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
        return m

    return run


def _fresh_copy(template: nn.Module) -> nn.Module:
    # Runs inside the trace: detach the copy's tensors from the modes by copying on meta first.
    with torch.utils._python_dispatch._disable_current_modes(), torch._C.DisableTorchFunction():
        return copy.deepcopy(template)


def _entries(model: nn.Module, sid_of: Callable[[torch.Tensor], int]) -> dict[str, TensorEntry]:
    out: dict[str, TensorEntry] = {}
    for kind, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in items:
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            persistent = kind == "parameter" or leaf not in module._non_persistent_buffers_set
            out[name] = TensorEntry(
                name, kind, persistent, t.shape, t.dtype, sid_of(t) if t.is_meta else None,
                tuple(t.stride()), t.storage_offset(),
            )
    return out


def _structure(model: nn.Module) -> list[tuple[str, str, tuple[int, ...], torch.dtype]]:
    return [("parameter", n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()] + [
        ("buffer", n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()
    ]
