"""Pretrained weights from a Hugging Face safetensors directory, read a rectangle at a time.

``SafetensorsSource(DIR)`` reads ``DIR/model.safetensors`` or the shards that
``DIR/model.safetensors.index.json`` names. Only the file headers are read up front (and
checked: a truncated file or an index naming a missing shard fails here, naming the file);
values are read per requested rectangle through ``safe_open(...).get_slice(key)[rect]``, which
copies just those bytes out of the memory map, so no rank ever reads a whole file. Safetensors
only: pickle checkpoints (``pytorch_model.bin``) are refused, not loaded.

Names are the model's. :meth:`SafetensorsSource.for_model` maps them from the checkpoint's the
way ``from_pretrained`` does (see :mod:`models.hf_checkpoint_keys`): tied aliases
(``lm_head.weight`` absent when tied to the embedding), transformers' renamings (GPT-NeoX's
``embed_out`` -> ``lm_head``) and converters (Mixtral's per-expert ``w1``/``w3`` stacked into
``experts.gate_up_proj``: read one converted tensor at a time, from the experts whose rows are
asked for when it stacks experts, whole otherwise, then sliced).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from models.checkpoint_dir import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    CheckpointCorrupt,
    CheckpointDtypeError,
    CheckpointError,
    CheckpointFileMissing,
    CheckpointShapeMismatch,
    CheckpointTensorMissing,
    NotAHuggingFaceDirectory,
    StoredTensor,
    read_header,
    scan_directory,
)
from models.tensor_source import Rect, Requests, normalize_rect

@dataclass
class CheckReport:
    """What :meth:`SafetensorsSource.check_against` found that is not an error."""

    unexpected: list[str] = field(default_factory=list)  # stored, not expected (ignored)
    cast: dict[str, tuple[torch.dtype, torch.dtype]] = field(default_factory=dict)  # name: (stored, model)


class SafetensorsSource:
    """A :class:`~models.tensor_source.TensorSource` over a Hugging Face safetensors directory.

    ``aliases`` (``{alias: canonical}``, e.g. :func:`models.anatomy.tied_parameter_names`)
    names tied tensors: the canonical name is served from whichever of the two is stored.
    ``renames`` (``{checkpoint key: model name}``) and ``groups`` (converted tensors, see
    :mod:`models.hf_checkpoint_keys`) map stored keys to model names; :meth:`for_model` fills
    all three from a model.
    """

    def __init__(
        self,
        directory: Path | str,
        *,
        aliases: Mapping[str, str] | None = None,
        renames: Mapping[str, str] | None = None,
        groups: Sequence[object] = (),
    ) -> None:
        self.directory = Path(directory)
        self.listing, self._stored = scan_directory(self.directory)
        self._aliases = dict(aliases or {})
        renames = dict(renames or {})
        grouped = {k for g in groups for k in g.sources}
        self._keys: dict[str, str] = {}  # model name -> checkpoint key
        for key in self._stored:
            if key not in grouped:
                self._keys.setdefault(renames.get(key, key), key)
        for alias, canonical in self._aliases.items():
            key = self._keys.pop(alias, None)
            if canonical not in self._keys and key is not None:
                self._keys[canonical] = key
        self._groups = {name: g for g in groups for name in g.targets}
        self._cast: dict[str, torch.dtype] = {}

    @classmethod
    def for_model(cls, directory: Path | str, model: torch.nn.Module, *, cast: bool = True) -> SafetensorsSource:
        """A source for ``model`` (meta or real), checked against its parameters and persistent buffers."""
        from models.anatomy import tied_parameter_names
        from models.hf_checkpoint_keys import key_plan

        listing, stored = scan_directory(directory)
        renames, groups = key_plan(model, stored)
        src = cls(directory, aliases=tied_parameter_names(model), renames=renames, groups=groups)
        src.check_against(expected_tensors(model), cast=cast)
        return src

    # ----------------------------------------------------------------- the protocol

    def names(self) -> list[str]:
        return list(self._keys) + list(self._groups)

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def _canonical(self, name: str) -> str:
        name = self._aliases.get(name, name)
        if name not in self._keys and name not in self._groups:
            raise CheckpointTensorMissing(f"{self.listing} has no tensor {name}", path=self.listing, tensor=name)
        return name

    def shape(self, name: str) -> torch.Size:
        name = self._canonical(name)
        if name in self._groups:
            return self._groups[name].shapes[name]
        return torch.Size(self._stored[self._keys[name]].shape)

    def dtype(self, name: str) -> torch.dtype | None:
        """The dtype :meth:`read` returns (the model's, once cast by :meth:`check_against`)."""
        name = self._canonical(name)
        if name in self._cast:
            return self._cast[name]
        if name in self._groups:
            return self._groups[name].dtypes[name]
        return self._stored[self._keys[name]].dtype

    def file_of(self, name: str) -> Path:
        name = self._canonical(name)
        if name in self._groups:
            return self._stored[self._groups[name].sources[0]].file
        return self._stored[self._keys[name]].file

    def check_against(
        self,
        expected: Mapping[str, tuple[torch.Size | Sequence[int], torch.dtype]],
        *,
        cast: bool = True,
        optional: Sequence[str] = (),
    ) -> CheckReport:
        """Check every expected ``{name: (shape, dtype)}``; raise one :class:`CheckpointError` per problem.

        Names in ``optional`` may be absent. With ``cast`` a floating-point tensor stored in
        another floating dtype is read cast to the expected one (``from_pretrained`` does the
        same); any other dtype difference raises :class:`CheckpointDtypeError`.
        """
        missing = [
            n for n in expected if n not in optional and self._aliases.get(n, n) not in self._keys
            and self._aliases.get(n, n) not in self._groups
        ]
        if missing:
            raise CheckpointTensorMissing(
                f"{self.listing} lacks {len(missing)} tensor(s) the model needs: {', '.join(missing[:5])}"
                + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""),
                path=self.listing,
                tensor=missing[0],
            )
        report = CheckReport()
        for name, (shape, dtype) in expected.items():
            canonical = self._aliases.get(name, name)
            if canonical not in self._keys and canonical not in self._groups:
                continue
            path = self.file_of(canonical)
            stored_dtype = self._stored_dtype(canonical)
            if stored_dtype is None:
                code = self._stored[self._keys[canonical]].code
                raise CheckpointDtypeError(
                    f"{path}: tensor {name} is stored as {code}, which torch cannot hold",
                    path=path, tensor=name,
                )
            got = tuple(self.shape(canonical))
            if got != tuple(shape):
                raise CheckpointShapeMismatch(
                    f"{path}: tensor {name} has shape {list(got)}, the model expects {list(shape)}",
                    path=path, tensor=name,
                )
            if stored_dtype != dtype:
                if not (cast and stored_dtype.is_floating_point and dtype.is_floating_point):
                    raise CheckpointDtypeError(
                        f"{path}: tensor {name} is stored as {stored_dtype}, the model expects {dtype}"
                        + ("" if cast else " (casting is off)"),
                        path=path, tensor=name,
                    )
                self._cast[canonical] = dtype
                report.cast[name] = (stored_dtype, dtype)
        wanted = {self._aliases.get(n, n) for n in expected}
        report.unexpected = [n for n in self.names() if n not in wanted]
        return report

    def _stored_dtype(self, name: str) -> torch.dtype | None:
        if name in self._groups:
            return self._groups[name].dtypes[name]
        return self._stored[self._keys[name]].dtype

    def read(self, requests: Requests) -> Iterator[tuple[str, list[torch.Tensor]]]:
        """Yield ``(name, [tensor per rect])`` file by file, in on-disk order; reads only those bytes."""
        for name, rects, values in self._reads(requests):
            yield name, [v() for v in values]

    def fill(self, destinations: Mapping[str, Sequence[tuple[Rect, torch.Tensor]]]) -> None:
        """Copy each requested rectangle into its destination (any strides or device)."""
        requests = {n: [r for r, _ in items] for n, items in destinations.items()}
        for name, rects, values in self._reads(requests):
            for (_, dest), value in zip(destinations[name], values):
                dest.copy_(value())

    def _reads(self, requests: Requests):
        plain: dict[Path, list[tuple[int, str, str, list]]] = {}
        grouped: dict[int, tuple[object, list[tuple[str, str, list]]]] = {}
        for name, rects in requests.items():
            canonical = self._canonical(name)
            norm = [normalize_rect(name, self.shape(canonical), r) for r in rects]
            if canonical in self._groups:
                g = self._groups[canonical]
                grouped.setdefault(id(g), (g, []))[1].append((name, canonical, norm))
            else:
                st = self._stored[self._keys[canonical]]
                if st.dtype is None:
                    raise CheckpointDtypeError(
                        f"{st.file}: tensor {st.key} is stored as {st.code}, which torch cannot hold",
                        path=st.file, tensor=st.key,
                    )
                plain.setdefault(st.file, []).append((st.begin, name, canonical, norm))
        for path in sorted(plain):
            with safe_open(path, framework="pt") as f:
                for _, name, canonical, norm in sorted(plain[path], key=lambda j: j[0]):
                    key = self._keys[canonical]
                    dtype = self._cast.get(canonical)
                    yield name, norm, [_reader(f, key, r, dtype) for r in norm]
        for g, jobs in grouped.values():
            rows = _rows_spanned([r for _, _, norm in jobs for r in norm]) if g.stacks_rows() else None
            values = g.materialize(self._stored, self._cast, rows)
            lo = rows[0] if rows is not None else 0
            for name, canonical, norm in jobs:
                part = values[canonical]
                shifted = [(slice(r[0].start - lo, r[0].stop - lo), *r[1:]) if r else r for r in norm]
                yield name, norm, [(lambda r=r, part=part: part[r].clone(memory_format=torch.contiguous_format))
                                   for r in shifted]
            del values


def _rows_spanned(rects: list[tuple[slice, ...]]) -> tuple[int, int] | None:
    """The dim-0 rows ``[lo, hi)`` that normalized rectangles touch (None: one is 0-d, read whole)."""
    if not rects or any(not r for r in rects):
        return None
    lo, hi = min(r[0].start for r in rects), max(r[0].stop for r in rects)
    return (lo, hi) if lo < hi else None


def _reader(f, key: str, rect: tuple[slice, ...], dtype: torch.dtype | None):
    def read() -> torch.Tensor:
        # get_slice copies just the rectangle's bytes out of the memory map; a 0-d tensor has no
        # slice syntax, and is one element anyway.
        t = f.get_slice(key)[rect] if rect else f.get_tensor(key)
        t = t.contiguous()
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    return read


def expected_tensors(model: torch.nn.Module) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """``{name: (shape, dtype)}`` of the parameters (tied once) and persistent buffers of ``model``."""
    out = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    for name, b in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if leaf not in module._non_persistent_buffers_set:
            out[name] = (b.shape, b.dtype)
    return out


__all__ = [
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "CheckReport",
    "CheckpointCorrupt",
    "CheckpointDtypeError",
    "CheckpointError",
    "CheckpointFileMissing",
    "CheckpointShapeMismatch",
    "CheckpointTensorMissing",
    "NotAHuggingFaceDirectory",
    "SafetensorsSource",
    "StoredTensor",
    "expected_tensors",
    "read_header",
    "scan_directory",
]
