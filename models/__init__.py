"""Per-architecture knowledge of Hugging Face causal LMs (fetch units, tied weights, plans).

The two sources of a model's values live in their own modules, imported where they are used:
``models.materialize.InitReplay`` (eager init replayed on a meta model) and
``models.pretrained.SafetensorsSource`` (a pretrained safetensors directory read by slices).
"""

from models.anatomy import fetch_unit_modules, tied_parameter_names

__all__ = ["fetch_unit_modules", "tied_parameter_names"]
