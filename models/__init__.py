"""Per-architecture knowledge of Hugging Face causal LMs (fetch units, tied weights, plans),
and the two sources of a model's values: eager init replayed on a meta model, and a
pretrained safetensors directory read by rectangles."""

from models.anatomy import fetch_unit_modules, tied_parameter_names
from models.materialize import (
    InitReplay,
    MaterializeError,
    MetaBuildDrewError,
    NoInitializerError,
    ReplayMismatchError,
    UninitializedTensorError,
)
from models.pretrained import (
    CheckpointCorrupt,
    CheckpointDtypeError,
    CheckpointError,
    CheckpointFileMissing,
    CheckpointShapeMismatch,
    CheckpointTensorMissing,
    NotAHuggingFaceDirectory,
    SafetensorsSource,
    expected_tensors,
)
from models.tensor_source import Rect, RectError, TensorSource, normalize_rect, whole

__all__ = [
    "CheckpointCorrupt",
    "CheckpointDtypeError",
    "CheckpointError",
    "CheckpointFileMissing",
    "CheckpointShapeMismatch",
    "CheckpointTensorMissing",
    "InitReplay",
    "MaterializeError",
    "MetaBuildDrewError",
    "NoInitializerError",
    "NotAHuggingFaceDirectory",
    "Rect",
    "RectError",
    "ReplayMismatchError",
    "SafetensorsSource",
    "TensorSource",
    "UninitializedTensorError",
    "expected_tensors",
    "fetch_unit_modules",
    "normalize_rect",
    "tied_parameter_names",
    "whole",
]
