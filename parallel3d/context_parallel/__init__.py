"""Context parallelism: each rank of a ``cp`` group keeps 1/cp of every sequence (docs/context_parallel.md).

``check_context_parallel`` runs with the rest of the config validation, before any collective;
``apply_context_parallel`` switches the model's attention to Ulysses or ring attention over
``mesh.groups.cp`` (``context_parallel.method``) and
returns the ``SequenceSplit`` the engine cuts each micro-batch with.
"""

from __future__ import annotations

from torch import nn

from parallel3d.context_parallel.batch import SequenceSplit
from parallel3d.context_parallel.model import check_model, install_attention, windowed_layers
from parallel3d.runtime.mesh import ParallelMesh

__all__ = ["SequenceSplit", "apply_context_parallel", "check_context_parallel"]


def _hf_model(model: nn.Module) -> nn.Module:
    """The transformers model whose attention is switched: ``model``, or a PEFT wrapper's base model
    (the wrapper's forward hands the cut's keyword arguments through to it)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and not hasattr(model, "set_attn_implementation") else model


def check_context_parallel(model: nn.Module, config) -> None:
    """Raise ConfigError if ``config.context_parallel`` cannot run ``model`` (cp 1 always can)."""
    cp = config.context_parallel.size
    if cp > 1:
        check_model(_hf_model(model), cp, config.tensor_parallel.size, config.context_parallel.method)


def apply_context_parallel(model: nn.Module, config, mesh: ParallelMesh) -> SequenceSplit | None:
    """Switch ``model`` to the configured cp attention over the cp group (cp > 1); the engine's batch cutter."""
    if mesh.cp == 1:
        return None
    model = _hf_model(model)
    attention = install_attention(model, mesh.groups.cp, config.context_parallel.method)
    layers = model.config.get_text_config().num_hidden_layers
    return SequenceSplit(attention, mesh.local_rank("cp"), config.loss_normalization == "tokens", layers,
                         windowed_layers(model))
