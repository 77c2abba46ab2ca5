"""``zero3d plan`` on families beyond Llama: it plans what ``initialize`` would run and says why
it leaves the rest out, instead of failing inside the model's code.

* tensor parallelism refuses for the planner exactly what it refuses for the engine (one
  ``prepare_tensor_parallel``), narrows BLOOM's per-head ALiBi, and prices the loss on a rank's
  vocabulary slice whatever the model's own loss code reads (Gemma 2's ``self.vocab_size``);
* pipeline stages are left out, with the engine's reason, for a model they cannot split
  (Bamba: no pipeline plan), and the other layouts are still planned;
* a layout whose profile fails in the model's code is left out with the error, not raised;
* the profile's one- and two-layer configs keep a hybrid model's per-layer lists consistent
  (``models.layer_configs.with_layers``).
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, BambaConfig, BloomConfig, Gemma2Config

from models.layer_configs import with_layers
from parallel3d.cli import main as zero3d

SMALL = dict(vocab_size=256, hidden_size=64, num_attention_heads=4)


def _plan(capsys, path, *args) -> tuple[int, str, str]:
    code = zero3d(["plan", str(path), "--gpus", "4", "--gpu-memory", "4GB", "--seq-len", "32", "--global-batch", "8",
                   "--json", "--top", "50", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("config", [
    BloomConfig(**SMALL, n_layer=2),
    Gemma2Config(**SMALL, intermediate_size=128, num_hidden_layers=2, num_key_value_heads=2, head_dim=16),
], ids=["bloom", "gemma2"])
def test_tensor_parallel_layouts_are_priced(capsys, tmp_path, config):
    config.save_pretrained(tmp_path)
    code, out, err = _plan(capsys, tmp_path, "--tp", 2, "--pp", 1, "--zero-stage", 1)
    assert code == 0, err
    rows = json.loads(out)
    assert rows and all(" tp2 " in r["layout"] for r in rows)


def test_a_model_pipelines_cannot_split_is_planned_without_them(capsys, tmp_path):
    BambaConfig(**SMALL, intermediate_size=128, num_hidden_layers=4, num_key_value_heads=2, mamba_n_heads=4,
                mamba_d_head=32, attn_layer_indices=[1, 3]).save_pretrained(tmp_path)
    code, out, err = _plan(capsys, tmp_path, "--tp", 1)
    assert code == 0, err
    assert {r["layout"].split()[0] for r in json.loads(out)} == {"pp1"}
    code, _, err = _plan(capsys, tmp_path, "--tp", 1, "--pp", 2)
    assert code == 1 and "not considered: pp > 1" in err and "no base_model_pp_plan" in err


def test_a_profile_that_fails_leaves_its_layouts_out(capsys, tmp_path, monkeypatch):
    from parallel3d.planner import predict

    real = predict.profile_pass

    def fails_at_tp2(*args, **kwargs):
        if kwargs.get("tp") == 2:
            raise RuntimeError("a shape this model's code cannot take")
        return real(*args, **kwargs)

    monkeypatch.setattr(predict, "profile_pass", fails_at_tp2)
    Gemma2Config(**SMALL, intermediate_size=128, num_hidden_layers=2, num_key_value_heads=2,
                 head_dim=16).save_pretrained(tmp_path)
    code, out, err = _plan(capsys, tmp_path, "--zero-stage", 1, "--pp", 1)
    assert code == 0, err
    assert {r["layout"].split()[2] for r in json.loads(out)} <= {"tp1", "tp4"}
    code, _, err = _plan(capsys, tmp_path, "--zero-stage", 1, "--pp", 1, "--tp", 2)
    assert code == 1 and "fail on the profile's fake tensors" in err and "a shape this model's code cannot take" in err


@pytest.mark.parametrize("model_type,count", [("bamba", 2), ("olmo_hybrid", 2), ("nemotron_h", 1), ("gemma2", 1)])
def test_configs_cut_to_a_few_layers_stay_consistent(model_type, count):
    config = AutoConfig.for_model(model_type)
    cut = with_layers(config, count)
    assert cut.num_hidden_layers == count
    for name, value in vars(cut).items():
        if isinstance(value, list) and isinstance(getattr(config, name), list) \
                and len(getattr(config, name)) == config.num_hidden_layers:
            assert len(value) == count, name
    assert config.num_hidden_layers > count  # the original is unchanged
