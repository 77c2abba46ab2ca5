"""SafetensorsSource: rectangles of a Hugging Face directory, equal to from_pretrained's weights."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from transformers import AutoModelForCausalLM

import models.pretrained as pretrained
from models.materialize import InitReplay
from models.pretrained import (
    CheckpointCorrupt,
    CheckpointDtypeError,
    CheckpointFileMissing,
    CheckpointShapeMismatch,
    CheckpointTensorMissing,
    NotAHuggingFaceDirectory,
    SafetensorsSource,
    expected_tensors,
)
from models.tensor_source import RectError, TensorSource, whole
from tests.tiny_families import tiny_config


def _save(tmp_path, family: str, *, name: str = "ckpt", dtype=None, **save_kwargs):
    cfg = tiny_config(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, **({"dtype": dtype} if dtype else {}))
    d = tmp_path / name
    model.save_pretrained(d, **save_kwargs)
    with torch.device("meta"):  # a fresh config: from_config wrote the dtype into the first
        meta = AutoModelForCausalLM.from_config(tiny_config(family))
    return d, meta


def _loaded(d) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(d)
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers())
    return {n: t.detach() for n, t in out.items()}


def _rects(shape):
    if not shape:
        return [()]
    n = shape[0]
    rects = [(), (slice(n // 2, n // 2 + 1),), (slice(1, n),)]
    if len(shape) > 1:
        rects.append((slice(None), slice(2, shape[1] - 1)))
    return rects


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["single", "sharded"])
def test_rectangles_equal_from_pretrained(tmp_path, shard):
    d, meta = _save(tmp_path, "llama_tied", **({"max_shard_size": shard} if shard else {}))
    src = SafetensorsSource.for_model(d, meta)
    assert isinstance(src, TensorSource)
    if shard:
        assert src.listing.name == "model.safetensors.index.json" and len(list(d.glob("*.safetensors"))) > 1
    assert "lm_head.weight" not in src.names() and src.aliases() == {"lm_head.weight": "model.embed_tokens.weight"}
    ref = _loaded(d)
    names = src.names() + ["lm_head.weight"]
    requests = {n: _rects(src.shape(n)) for n in names}
    got = dict(src.read(requests))
    assert set(got) == set(names)
    for n in names:
        for rect, value in zip(requests[n], got[n]):
            assert value.is_contiguous() and torch.equal(value, ref[n][rect]), (n, rect)


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "mixtral", "opt"])
def test_families_match_from_pretrained(tmp_path, family):
    # gpt2/opt: tied; gpt_neox: stored as embed_out (a renaming); mixtral: per-expert tensors
    # stacked into experts.gate_up_proj (a converter)
    d, meta = _save(tmp_path, family)
    src = SafetensorsSource.for_model(d, meta)
    ref = _loaded(d)
    assert set(src.names()) == set(expected_tensors(meta))
    got = dict(src.read({n: [(), (slice(0, 1),)] for n in src.names()}))
    for n, (whole_value, row) in got.items():
        assert torch.equal(whole_value, ref[n]) and torch.equal(row, ref[n][:1]), n


def test_pretrained_plus_replayed_buffers_is_the_whole_model(tmp_path):
    d, meta = _save(tmp_path, "gemma")
    params = dict(SafetensorsSource.for_model(d, meta).read(whole(expected_tensors(meta))))
    before = torch.get_rng_state()
    bufs = dict(InitReplay(meta).buffers())  # rotary inv_freq, embed_scale: not in the checkpoint
    assert torch.equal(torch.get_rng_state(), before)
    ref = _loaded(d)
    assert set(params) | set(bufs) | {"lm_head.weight"} == set(ref)
    assert all(torch.equal(v[0], ref[n]) for n, v in params.items())
    assert all(torch.equal(v, ref[n]) for n, v in bufs.items())


def test_reads_slices_never_whole_tensors(tmp_path, monkeypatch):
    d, meta = _save(tmp_path, "llama")
    calls = []
    real_open = pretrained.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_slice(self, key):
            calls.append(("slice", key))
            return self.f.get_slice(key)

        def get_tensor(self, key):
            calls.append(("whole", key))
            return self.f.get_tensor(key)

    src = SafetensorsSource.for_model(d, meta)
    monkeypatch.setattr(pretrained, "safe_open", Spy)
    got = dict(src.read({"model.embed_tokens.weight": [(slice(5, 7), slice(0, 4))]}))
    assert calls == [("slice", "model.embed_tokens.weight")]
    assert got["model.embed_tokens.weight"][0].shape == (2, 4)


def test_bf16_checkpoint_is_cast_like_from_pretrained(tmp_path):
    d, meta = _save(tmp_path, "llama", dtype=torch.bfloat16)
    src = SafetensorsSource.for_model(d, meta)  # meta is fp32
    name = "model.layers.0.mlp.up_proj.weight"
    ((_, (value,)),) = list(src.read({name: [(slice(0, 3),)]}))
    assert value.dtype == torch.float32 and src.dtype(name) == torch.float32
    assert torch.equal(value, _loaded(d)[name].float()[:3])
    with pytest.raises(CheckpointDtypeError, match=rf"model.safetensors: tensor {name} is stored as torch.bfloat16"):
        SafetensorsSource(d).check_against({name: ((48, 32), torch.float32)}, cast=False)


def test_not_a_huggingface_directory(tmp_path):
    with pytest.raises(NotAHuggingFaceDirectory, match="does not exist"):
        SafetensorsSource(tmp_path / "nope")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(NotAHuggingFaceDirectory, match=r"expected model.safetensors or model.safetensors.index.json.*Pickle") as e:
        SafetensorsSource(tmp_path)
    assert str(tmp_path) in str(e.value) and e.value.path == tmp_path


def test_index_naming_a_missing_shard(tmp_path):
    d, _ = _save(tmp_path, "llama", max_shard_size="20KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (d / victim).unlink()
    with pytest.raises(CheckpointFileMissing, match=rf"names shard {victim}, which is not in .*holds ") as e:
        SafetensorsSource(d)
    assert e.value.path.name == victim and e.value.tensor in index["weight_map"]


def test_index_entry_absent_from_its_file(tmp_path):
    d, _ = _save(tmp_path, "llama", max_shard_size="20KB")
    path = d / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    files = sorted(set(index["weight_map"].values()))
    key = next(k for k, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][key] = files[1]
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointTensorMissing, match=rf"says {files[1]} holds tensor {key}"):
        SafetensorsSource(d)


def test_truncated_file(tmp_path):
    d, _ = _save(tmp_path, "llama")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointCorrupt, match=r"model.safetensors: tensor .* past the end of the file"):
        SafetensorsSource(d)
    f.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointCorrupt, match="not a safetensors file"):
        SafetensorsSource(d)


def test_missing_tensor_and_wrong_shape(tmp_path):
    d, meta = _save(tmp_path, "llama")
    src = SafetensorsSource(d)
    expected = expected_tensors(meta)
    with pytest.raises(CheckpointTensorMissing, match=r"model.safetensors lacks 1 tensor\(s\) the model needs: extra.weight") as e:
        src.check_against({**expected, "extra.weight": ((2,), torch.float32)})
    assert e.value.tensor == "extra.weight"
    wrong = {**expected, "model.norm.weight": ((33,), torch.float32)}
    with pytest.raises(CheckpointShapeMismatch, match=r"model.safetensors: tensor model.norm.weight has shape \[32\], the model expects \[33\]"):
        src.check_against(wrong)
    report = src.check_against({k: v for k, v in expected.items() if k != "model.norm.weight"})
    assert report.unexpected == ["model.norm.weight"] and report.cast == {}


def test_unsupported_dtype(tmp_path):
    header = json.dumps({"x": {"dtype": "F6_E3M2", "shape": [4], "data_offsets": [0, 3]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0\0")
    src = SafetensorsSource(tmp_path)
    with pytest.raises(CheckpointDtypeError, match=r"model.safetensors: tensor x is stored as F6_E3M2, which torch cannot hold"):
        src.check_against({"x": ((4,), torch.float32)})
    with pytest.raises(CheckpointDtypeError, match="F6_E3M2"):
        list(src.read({"x": [()]}))


def test_bad_rectangle_and_unknown_name(tmp_path):
    d, _ = _save(tmp_path, "llama")
    src = SafetensorsSource(d)
    with pytest.raises(RectError, match="model.norm.weight: rectangle"):
        list(src.read({"model.norm.weight": [(slice(0, 40),)]}))
    with pytest.raises(CheckpointTensorMissing, match="has no tensor model.nope"):
        src.shape("model.nope")
