"""Chunks to and from disk with torch.distributed.checkpoint (DCP), without pickle on load.

DCP does the distributed part: every rank proposes the chunks it holds, the coordinator
drops duplicates (a replicated tensor is written once) and checks that the chunks of each
tensor tile it exactly, and on load each rank reads only the saved chunks that intersect
its own (DCP's resharding). Two things of DCP's file format are replaced:

* the global metadata, which DCP pickles (``pickle.load`` on a crafted file runs code), is
  written as JSON (``dcp.json``) and parsed back into DCP's dataclasses;
* every stored chunk gets a checksum (XXH3) in that JSON, and a rank verifies the bytes of every
  chunk it is about to read while planning, so a damaged file stops every rank (the caller
  agrees on planning errors) before any tensor is overwritten.

A load plans on each rank alone (`plan_load`): the reads follow from the metadata, so DCP's
coordinator round trips are skipped and the ranks agree with one all-reduce instead.

Chunk data stay DCP's per-rank ``__R_0.distcp`` files of ``torch.save``d tensors, read with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import mmap
import os
import pickle
import re
import shutil
import zlib
from contextlib import contextmanager
from collections.abc import Sequence
from pathlib import Path

import torch
import xxhash
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from parallel3d.checkpoint.chunks import Chunk
from parallel3d.checkpoint.manifest import METADATA_FILE
from parallel3d.errors import ConfigError
from parallel3d.runtime.worker_errors import reported_by_rank0

FORMAT = "zero3d-dcp-json/2"
CHECKSUM = "xxh3_64"
"""Every chunk's checksum: XXH3 (64 bits) runs at memory speed (25 GB/s on a core where zlib's
CRC-32 makes 4-6), and the checksums are computed over every byte written and verified over every
byte read. Checkpoints of format /1 carry CRC-32s and still load."""
CHECKSUM_OF_FORMAT = {"zero3d-dcp-json/1": "crc32", FORMAT: CHECKSUM}
DTYPES_BY_NAME = {str(t).removeprefix("torch."): t for t in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}


class CorruptCheckpointError(ConfigError):
    """A stored chunk's bytes do not match the checksum written with it, or cannot be read as a tensor."""


@dataclasses.dataclass
class _CheckedStorageInfo(_StorageInfo):
    checksum: int = 0
    algorithm: str = CHECKSUM


def checksum(data, algorithm: str = CHECKSUM) -> int:
    """The checksum of a bytes-like object (``algorithm``: ``xxh3_64``, or ``crc32`` of format /1)."""
    return xxhash.xxh3_64_intdigest(data) if algorithm == "xxh3_64" else zlib.crc32(data)


def write_json_atomically(path: Path, doc: dict) -> None:
    """Write ``doc`` to a temporary sibling, fsync it, and rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _file_checksum(path: Path, offset: int, length: int, algorithm: str = CHECKSUM) -> int:
    """The checksum of ``length`` bytes of ``path`` at ``offset``, through a memory map (no copy)."""
    if length == 0:
        return checksum(b"", algorithm)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        with memoryview(mapped) as view:
            return checksum(view[offset : offset + length], algorithm)


class _ChecksummingStream(io.RawIOBase):
    """A file being written that keeps the checksum of the bytes between consecutive ``tell()`` calls.

    DCP's writer calls ``tell()`` just before and just after it writes each chunk, so the
    segment between those two calls is the chunk: its checksum is known without reading the
    file back. A chunk whose bounds are not such a segment is read back instead (see _Writer).
    """

    def __init__(self, raw, segments: dict[tuple[str, int, int], int], name: str) -> None:
        super().__init__()
        self.raw, self.segments, self.name = raw, segments, name
        self.start, self.hasher = raw.tell(), xxhash.xxh3_64()

    def write(self, data) -> int:
        self.hasher.update(data)
        return self.raw.write(data)

    def tell(self) -> int:
        position = self.raw.tell()
        self.segments[(self.name, self.start, position)] = self.hasher.intdigest()
        self.start = position
        self.hasher.reset()
        return position

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        super().close()  # flushes through to the file first
        self.raw.close()


class _ChecksummingFileSystem(FileSystem):
    """DCP's local file system, with every file it writes wrapped in a :class:`_ChecksummingStream`."""

    def __init__(self) -> None:
        super().__init__()
        self.segments: dict[tuple[str, int, int], int] = {}

    @contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as raw:
            yield _ChecksummingStream(raw, self.segments, Path(path).name) if "w" in mode else raw


# ---- metadata as JSON -------------------------------------------------------------------


def metadata_to_json(md: Metadata, save_id: str | None = None) -> dict:
    tensors = {}
    for fqn, tmd in md.state_dict_metadata.items():
        if not isinstance(tmd, TensorStorageMetadata):
            raise TypeError(f"{fqn}: only tensors are stored in a zero3d checkpoint's DCP part")
        tensors[fqn] = {"dtype": str(tmd.properties.dtype).removeprefix("torch."), "size": list(tmd.size),
                        "chunks": []}
    for index, info in md.storage_data.items():
        chunk = next(c for c in md.state_dict_metadata[index.fqn].chunks if list(c.offsets) == list(index.offset))
        tensors[index.fqn]["chunks"].append({
            "offsets": list(chunk.offsets), "sizes": list(chunk.sizes), "file": info.relative_path,
            "offset": info.offset, "length": info.length, CHECKSUM: info.checksum})
    doc = {"format": FORMAT, "tensors": tensors}
    if save_id is not None:  # the same id is in the checkpoint's manifest (parallel3d/checkpoint/manifest.py)
        doc["save_id"] = save_id
    return doc


def metadata_from_json(doc: dict, where: Path) -> Metadata:
    """DCP ``Metadata`` from :func:`metadata_to_json`'s document, every field checked."""
    try:
        algorithm = CHECKSUM_OF_FORMAT.get(doc.get("format"))
        if algorithm is None:
            raise ValueError(f"format {doc.get('format')!r}, expected one of {sorted(CHECKSUM_OF_FORMAT)}")
        state, storage = {}, {}
        for fqn, t in doc["tensors"].items():
            chunks = []
            for c in t["chunks"]:
                offsets, sizes = torch.Size(map(int, c["offsets"])), torch.Size(map(int, c["sizes"]))
                file = str(c["file"])
                if Path(file).name != file or file.startswith("."):
                    raise ValueError(f"{fqn}: file name {file!r} is not a plain file name")
                chunks.append(ChunkStorageMetadata(offsets, sizes))
                storage[MetadataIndex(fqn, offsets)] = _CheckedStorageInfo(
                    file, int(c["offset"]), int(c["length"]), None, int(c[algorithm]), algorithm)
            state[fqn] = TensorStorageMetadata(TensorProperties(dtype=DTYPES_BY_NAME[t["dtype"]]),
                                               torch.Size(map(int, t["size"])), chunks)
        save_id = doc.get("save_id")
        if save_id is not None and not isinstance(save_id, str):
            raise ValueError(f"save_id {save_id!r} is not a string")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{where} is not a valid zero3d checkpoint metadata file: {exc!r}") from None
    return Metadata(state_dict_metadata=state, storage_data=storage,
                    storage_meta=StorageMeta(save_id=save_id) if save_id is not None else None)


def read_metadata(directory: Path) -> Metadata:
    path = directory / METADATA_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"checkpoint {directory} has no {METADATA_FILE}; the save did not complete") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is unreadable: {exc}") from None
    return metadata_from_json(doc, path)


def loader_refusal(exc: BaseException) -> str:
    """The weights-only loader's reason for refusing a pickle, on one line without terminal codes
    (such as "Unsupported global: GLOBAL io.open was not an allowed global by default")."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    for line in text.splitlines():
        if "WeightsUnpickler error:" in line and (reason := line.split("WeightsUnpickler error:", 1)[1].strip()):
            return reason.split(". Please", 1)[0].rstrip(".")
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip() and not p.strip().startswith("Check the doc")]
    return (paragraphs[-1].splitlines()[0] if paragraphs else type(exc).__name__).rstrip(".")


def read_chunk(directory: Path, md: Metadata, fqn: str, offsets: Sequence[int]) -> torch.Tensor:
    """One stored chunk, checksum verified (for readers outside DCP: export)."""
    info = md.storage_data[MetadataIndex(fqn, torch.Size(offsets))]
    path = directory / info.relative_path
    with open(path, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    if len(data) != info.length or checksum(data, info.algorithm) != info.checksum:
        raise CorruptCheckpointError(f"checkpoint file {path} is damaged: the chunk of {fqn} at {list(offsets)} "
                                     "does not match its checksum (truncated or altered)")
    try:
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        raise ConfigError(f"checkpoint file {path}: the chunk of {fqn} at {list(offsets)} is not a plain tensor "
                          f"(the weights-only loader refused it: {loader_refusal(exc)}); the checkpoint was "
                          "altered or not written by zero3d, and nothing in it was run") from None
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"checkpoint file {path}: the chunk of {fqn} at {list(offsets)} holds a "
                          f"{type(tensor).__name__}, not a tensor; the checkpoint was altered or not written by zero3d")
    return tensor


class _Writer(FileSystemWriter):
    """DCP's file writer, with a checksum per chunk (computed as it writes) and the metadata as JSON."""

    def __init__(self, *args, manifest_save_id: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fs = _ChecksummingFileSystem()
        self.manifest_save_id = manifest_save_id

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        results = future.wait()
        checked = []
        for r in results:
            info = r.storage_data
            digest = self.fs.segments.get((info.relative_path, info.offset, info.offset + info.length))
            if digest is None:
                digest = _file_checksum(Path(self.path) / info.relative_path, info.offset, info.length)
            checked.append(dataclasses.replace(r, storage_data=_CheckedStorageInfo(
                info.relative_path, info.offset, info.length, info.transform_descriptors, digest)))
        future = torch.futures.Future()
        future.set_result(checked)
        return future

    def finish(self, metadata: Metadata, results) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        write_json_atomically(Path(self.path) / METADATA_FILE, metadata_to_json(metadata, self.manifest_save_id))


class _Reader(FileSystemReader):
    """DCP's file reader: JSON metadata, and every chunk a rank will read verified first."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return read_metadata(Path(self.path))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        seen = set()
        for item in plan.items:
            if item.storage_index in seen:
                continue
            seen.add(item.storage_index)
            info = self.storage_data[item.storage_index]
            path = Path(self.path) / info.relative_path
            size = path.stat().st_size if path.is_file() else -1
            if (size < info.offset + info.length
                    or _file_checksum(path, info.offset, info.length, info.algorithm) != info.checksum):
                what = "missing" if size < 0 else ("truncated" if size < info.offset + info.length else "altered")
                raise CorruptCheckpointError(
                    f"checkpoint file {path} is damaged ({what}): the chunk of {item.storage_index.fqn} at "
                    f"{list(item.storage_index.offset)} does not match its checksum")
        return plan


class _SavePlanner(DefaultSavePlanner):
    def __init__(self, chunks: list[Chunk]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True)
        self.chunks = {c.key: c for c in chunks}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(
            index=MetadataIndex(c.name, torch.Size(c.offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)),
                properties=TensorProperties(dtype=c.view.dtype),
                size=torch.Size(c.global_shape)))
            for c in self.chunks.values()]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return own_storage(self.chunks[(write_item.index.fqn, tuple(write_item.index.offset))].view.detach())


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a tensor whose storage is exactly those bytes, without a copy.

    A chunk is a view into a flat ZeRO buffer; DCP's writer clones every CPU tensor whose
    storage is larger than the tensor before ``torch.save`` writes it (so that the rest of the
    storage is not written), which costs a copy of the whole checkpoint in fresh memory. A
    storage made over the view's own bytes (through NumPy, which shares them) needs no clone.
    """
    if tensor.device.type != "cpu" or tensor.numel() == 0 or not tensor.is_contiguous() or (
            tensor.untyped_storage().nbytes() == tensor.nbytes):
        return tensor
    as_bytes = torch.from_numpy(tensor.reshape(-1).view(torch.uint8).numpy())
    return as_bytes.view(tensor.dtype).view(tensor.shape)


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self, chunks: list[Chunk]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = {c.key: c for c in chunks}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for (name, offsets), c in self.chunks.items():
            wanted = ChunkStorageMetadata(torch.Size(offsets), torch.Size(c.sizes))
            items += create_read_items_for_chunk_list(name, self.metadata.state_dict_metadata[name], [wanted])
        return LoadPlan(items)

    def resolve_tensor(self, read_item) -> torch.Tensor:
        view = self.chunks[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))].view
        return narrow_tensor_by_index(view, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        """Nothing to do: ``resolve_tensor`` handed out the destination itself."""


def _first_failure(exc: CheckpointException, directory: Path, what: str) -> ConfigError:
    """The first failing rank's error, as a ConfigError (DCP raises it on every rank: marked as
    the one rank 0 prints, so a worker prints it once)."""
    rank, (error, _) = next(iter(exc.failures.items()))
    if isinstance(error, ConfigError):
        return reported_by_rank0(type(error)(str(error)))
    why = disk_full_text(error, directory) or repr(error)
    return reported_by_rank0(ConfigError(f"{what} checkpoint {directory} failed on rank {rank}: {why}"))


def _free_space(directory: Path) -> str:
    for place in (directory.parent, *directory.parent.parents):  # the save dir: it outlives a failed .tmp
        try:
            return f"{shutil.disk_usage(place).free / 2**20:.1f} MiB free on the device of {place}"
        except OSError:
            continue
    return "free space unknown"


def disk_full_text(error: BaseException, directory: Path) -> str | None:
    """"no space left on device ..." (with the device's free space) when the error or its cause
    says ENOSPC (or EDQUOT), or torch's zip writer reports a short write ("unexpected pos"), which
    is how a full disk shows through ``torch.save``; None for any other error."""
    seen: BaseException | None = error
    while seen is not None:
        if (isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT)) or (
                "No space left on device" in str(seen)):
            return f"no space left on device ({_free_space(directory)}): {error}"
        if "unexpected pos" in str(seen):
            return (f"a file write came up short, as when there is no space left on device "
                    f"({_free_space(directory)}): {error}")
        seen = seen.__cause__ or seen.__context__
    return None


def save_chunks(directory: Path, chunks: list[Chunk], group: dist.ProcessGroup | None,
                zip_crc32: bool = True, save_id: str | None = None) -> None:
    """Write every rank's ``chunks`` under ``directory`` (collective over ``group``).

    ``zip_crc32=False`` skips the CRC-32 that ``torch.save`` computes over every record for
    its zip format (a fifth of a save's CPU time): each chunk already has its own checksum,
    verified on every load, and ``torch.load`` does not check the zip CRC. The switch is
    process-wide (``torch.serialization.set_crc32_options``), so only a save in the training
    thread uses it, and it is restored when the save returns. ``save_id`` (the coordinator's)
    goes into ``dcp.json``.
    """
    previous = torch.serialization.get_crc32_options()
    if not zip_crc32:
        torch.serialization.set_crc32_options(False)
    try:
        writer = _Writer(directory, single_file_per_rank=True, manifest_save_id=save_id)
        dcp.save({}, storage_writer=writer, planner=_SavePlanner(chunks), process_group=group)
    except CheckpointException as exc:
        raise _first_failure(exc, directory, "saving") from None
    finally:
        if not zip_crc32:  # a background save never touches the switch (another save may hold it)
            torch.serialization.set_crc32_options(previous)


@dataclasses.dataclass
class PlannedLoad:
    """One rank's part of a load: which stored chunks it reads into which of its tensors."""

    reader: _Reader
    planner: _LoadPlanner
    plan: LoadPlan


def plan_load(directory: Path, metadata: Metadata, chunks: list[Chunk]) -> PlannedLoad:
    """Plan this rank's reads of ``chunks`` and verify the stored bytes they need (no collective).

    DCP's own ``load`` would gather every rank's plan to a coordinator and scatter it back,
    then gather the results (pickled objects, three round trips); a load needs none of that:
    each rank's reads follow from the metadata alone. The caller agrees across ranks on the
    errors this raises (`CorruptCheckpointError` for a damaged chunk) before anything is read.
    """
    reader, planner = _Reader(directory), _LoadPlanner(chunks)
    reader.set_up_storage_reader(metadata, is_coordinator=False)
    planner.set_up_planner({}, metadata, is_coordinator=False)
    return PlannedLoad(reader, planner, reader.prepare_local_plan(planner.create_local_plan()))


def read_planned(load: PlannedLoad) -> None:
    """Fill this rank's tensors as planned (DCP's file reader; no collective)."""
    try:
        load.reader.read_data(load.plan, load.planner).wait()
    except ConfigError:
        raise
    except pickle.UnpicklingError as exc:  # a chunk holds pickled objects (its checksum matched)
        raise CorruptCheckpointError(f"checkpoint {load.reader.path}: a chunk is not a plain tensor (the weights-only loader "
                          f"refused it: {loader_refusal(exc)}); the checkpoint was altered or not written by zero3d, "
                          "and nothing in it was run") from None
    except Exception as exc:  # noqa: BLE001 - an I/O or format error, reported on every rank by the caller
        raise CorruptCheckpointError(f"loading checkpoint {load.reader.path} failed: {exc!r}") from None
