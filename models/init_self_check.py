"""The init replay checks itself against eager construction, once per process and family.

:class:`~models.materialize.InitReplay` reproduces eager construction by replaying it on the
meta device with every random op mirrored on the CPU. That rests on torch details no API
promises: which draws consume the generator and how (CPU ``normal_`` picks its algorithm by
size and contiguity, and ``uniform_``/``normal_`` may be cut in pieces without changing a value:
``init_execute._CHUNKABLE_DRAWS``), that torch's init functions skip meta tensors (the replay
answers ``is_meta`` with ``False``), which factory functions take a device. A torch release that
changes one of them makes the replay give other values than eager construction, and a model
would train from another start without a word.

So before a replay is trusted, the same family is built twice at a tiny size
(:func:`models.tiny_config.tiny_config`, in the model's dtype): eagerly from a seed, and on the
meta device then replayed, with draws cut in 64-byte pieces so the piecewise path runs on small
tensors too. Every tensor must match bit for bit and the generator must end in the same state,
or :class:`ReplaySelfCheckError` (a ``MaterializeError``, which ``initialize`` turns into a
``ConfigError``) says which tensor and what to do. A plain module of torch's own layers (one
with ``trunc_normal_``, whose rejection sampler branches on drawn values) is checked the same way
for every model, Hugging Face or not. Results are cached per process: one small build per family
(a few tenths of a second for the tiny configs).

A family whose tiny config transformers cannot build (a model registered by remote code, a
default config it does not run) is checked with the plain module only, and the log says so.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models.init_programs import MaterializeError

__all__ = ["ReplaySelfCheckError", "verify_replay"]

log = logging.getLogger(__name__)

SELF_CHECK_SEED = 20_251_127
SELF_CHECK_CHUNK_BYTES = 64  # draws over 128 bytes in pieces: the piecewise path runs on tiny tensors


_HOW = ("A torch release changed something the replay relies on (an init function's random stream, how a draw "
        "may be cut in pieces, a private torch detail). Build the model on the CPU instead of the meta device, or "
        "use a torch version the replay is tested with (docs/design.md, 'Widening the tested versions').")


class ReplaySelfCheckError(MaterializeError):
    """The replay of a small model of the family is not what eager construction gives."""


class _TruncNormal(nn.Module):
    """A layer initialized with ``trunc_normal_`` (a rejection sampler: how far the generator
    moves depends on the values it draws)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(40, 24, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, std=0.5, a=-0.6, b=0.6)


def _plain_reference(dtype: torch.dtype) -> Callable[[], nn.Module]:
    """Layers built in ``dtype`` (drawn in it, as the replay's ``reset_parameters()`` draws)."""
    def build() -> nn.Module:
        return nn.Sequential(nn.Embedding(37, 24, padding_idx=0, dtype=dtype), nn.Linear(24, 40, dtype=dtype),
                             nn.LayerNorm(40, dtype=dtype), _TruncNormal(dtype), nn.Conv1d(4, 8, 3, dtype=dtype))
    return build


_CHECKED: dict[tuple[Any, ...], str | None] = {}  # what was checked -> None (equal) or the reason it is not


def verify_replay(meta_model: nn.Module, is_hf: bool, replay_cls: type) -> None:
    """Raise :class:`ReplaySelfCheckError` when the replay (``replay_cls``: ``InitReplay``, passed in
    so that this module need not import the one that calls it) does not reproduce eager
    construction of a small model of ``meta_model``'s family under this torch (module docstring)."""
    dtype = next((p.dtype for p in meta_model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    checks: list[tuple[tuple[Any, ...], str, Callable[[], nn.Module] | None]] = [
        (("torch", dtype), f"torch's own layers in {dtype}", _plain_reference(dtype))]
    if is_hf:
        model_type = getattr(meta_model.config, "model_type", None)
        checks.append(((type(meta_model), model_type, dtype), f"a tiny {type(meta_model).__name__} "
                       f"(model_type={model_type!r}, {dtype})", None))
    for key, what, build in checks:
        if key not in _CHECKED:
            if build is None:
                build = _hf_reference(meta_model, dtype)
            _CHECKED[key] = None if build is None else _compare(build, what, replay_cls, strict=key[0] == "torch")
        if _CHECKED[key] is not None:
            raise ReplaySelfCheckError(_CHECKED[key])


def _hf_reference(meta_model: nn.Module, dtype: torch.dtype) -> Callable[[], nn.Module] | None:
    from models.tiny_config import tiny_config

    cls, model_type = type(meta_model), getattr(meta_model.config, "model_type", None)
    try:
        config = tiny_config(model_type)
        config.dtype = dtype
        with torch.device("meta"):
            cls._from_config(copy.deepcopy(config))
    except Exception as exc:  # noqa: BLE001 - any reason transformers cannot build it: checked without it
        log.info("init replay self-check: no tiny %s of model_type %r builds (%s: %s); checked with torch's own "
                 "layers only", cls.__name__, model_type, type(exc).__name__, str(exc).splitlines()[0][:120])
        return None
    return lambda: cls._from_config(copy.deepcopy(config))


def _compare(build: Callable[[], nn.Module], what: str, replay_cls: type, strict: bool) -> str | None:
    """None when the replay of ``build`` equals its eager run, else the message saying how not.

    ``strict``: a replay that refuses (a ``MaterializeError``) fails the check, as it does for torch's
    own layers, which replay on a torch the replay fits; a family's own refusal (tensors its init
    never writes) is left to the user's replay, which meets it too."""
    from models.tensor_source import whole

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SELF_CHECK_SEED)
        eager = build()
        after_eager = torch.get_rng_state()
        with torch.device("meta"):
            meta = build()
        try:
            replay = replay_cls(meta, seed=SELF_CHECK_SEED, self_check=False)
        except MaterializeError as exc:
            if strict:
                return (f"the init replay does not reproduce eager construction under torch {torch.__version__}: "
                        f"for {what}, built on the meta device, it refuses ({exc}). {_HOW}")
            log.info("init replay self-check of %s: %s", what, exc)
            return None
        replay.chunk_bytes = SELF_CHECK_CHUNK_BYTES
        got = dict(replay.read(whole(replay.names())))
        after_replay = torch.get_rng_state()
    want = {**dict(eager.named_parameters()), **dict(eager.named_buffers())}
    how = _HOW
    for name, (value,) in got.items():
        ref = want[name].detach()
        if value.dtype != ref.dtype or value.shape != ref.shape or not torch.equal(value, ref):
            return (f"the init replay does not reproduce eager construction under torch {torch.__version__}: for "
                    f"{what}, built eagerly and replayed from the meta device, {name} differs. {how}")
    if not torch.equal(after_eager, after_replay):
        return (f"the init replay does not reproduce eager construction under torch {torch.__version__}: for {what}, "
                f"the random generator ends in another state after the replay than after eager construction, so "
                f"every later draw would differ. {how}")
    return None
