"""Per-architecture knowledge of Hugging Face causal LMs (fetch units, tied weights, plans)."""

from models.anatomy import fetch_unit_modules, tied_parameter_names

__all__ = ["fetch_unit_modules", "tied_parameter_names"]
