"""``zero3d plan`` on families beyond Llama: it plans what ``initialize`` would run and says why
it leaves the rest out, instead of failing inside the model's code.

* tensor parallelism is the engine's own (``apply_tensor_parallel`` on a fake process group):
  it refuses for the planner exactly what it refuses for the engine, narrows BLOOM's per-head
  ALiBi, and prices the vocabulary-parallel loss whatever the model's own loss code reads
  (Gemma 2's ``self.vocab_size``);
* pipeline stages are left out, with the engine's reason, for a model they cannot split
  (Bamba: no pipeline plan), and the other layouts are still planned;
* a layout whose profile fails in the model's code is left out with the error, not raised;
* the profile's one- and two-layer configs keep a hybrid model's per-layer lists consistent,
  cut a composite config's text part, keep the attention implementation, go past a one-layer
  model's count, and never change the planner's own config (``models.layer_configs.with_layers``).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, BambaConfig, BloomConfig, Gemma2Config, LlamaConfig

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
    """An error raised while the model runs on fake tensors (here: in the vocabulary-parallel loss
    of every tp > 1 pass) leaves those layouts out with the error; the others are planned."""
    from parallel3d.tensor_parallel import forward

    def fails(*args, **kwargs):
        raise RuntimeError("a shape this model's code cannot take")

    monkeypatch.setattr(forward, "causal_lm_loss", fails)
    Gemma2Config(**SMALL, intermediate_size=128, num_hidden_layers=2, num_key_value_heads=2,
                 head_dim=16).save_pretrained(tmp_path)
    code, out, err = _plan(capsys, tmp_path, "--zero-stage", 1, "--pp", 1)
    assert code == 0, err
    assert {r["layout"].split()[2] for r in json.loads(out)} == {"tp1"}
    code, _, err = _plan(capsys, tmp_path, "--zero-stage", 1, "--pp", 1, "--tp", 2)
    assert code == 1 and "could not be priced" in err and "a shape this model's code cannot take" in err
    assert "more devices" not in err  # nothing was priced, so nothing was too big


@pytest.mark.parametrize("model_type", ["bamba", "olmo_hybrid", "nemotron_h", "gemma2", "dory", "gemma3", "qwen3_5"])
@pytest.mark.parametrize("count", [1, 2])
def test_configs_cut_to_a_few_layers_stay_consistent(model_type, count):
    """The counts the profile uses, for hybrids (per-layer lists, a validator that wants an
    attention layer, a count derived from a list, counts tied to other counts) and composite
    configs (the text part is cut)."""
    config = AutoConfig.for_model(model_type)
    before = config.to_dict()
    cut = with_layers(config, count)
    text, original = cut.get_text_config(), config.get_text_config()
    assert text.num_hidden_layers == count
    for name, value in vars(text).items():
        full = vars(original).get(name)
        if isinstance(value, list) and isinstance(full, list) and len(full) == original.num_hidden_layers:
            assert len(value) == count, name
    assert config.to_dict() == before  # the original is unchanged


def test_cutting_keeps_the_attention_and_never_returns_the_original():
    config = LlamaConfig(**SMALL, num_hidden_layers=1, attn_implementation="eager")
    two, one = with_layers(config, 2), with_layers(config, 1)
    assert two.num_hidden_layers == 2 and two._attn_implementation == "eager"
    assert one is not config and one._attn_implementation == "eager"


def test_a_profile_leaves_the_planners_config_alone():
    from parallel3d.planner.profile import profile_pass

    config = LlamaConfig(**SMALL, intermediate_size=128, num_hidden_layers=2, num_key_value_heads=2)
    before = config.to_dict()
    profile_pass(config, "only", 2, micro_batch=1, seq=16, dtype=torch.float32, tp=2)
    assert config.to_dict() == before


def test_a_one_layer_model_is_planned_and_llama_prices_every_layout(capsys, tmp_path):
    from parallel3d.planner.hardware import a100
    from parallel3d.planner.predict import Planner, Workload
    from parallel3d.planner.search import Choice, candidates, search

    one = tmp_path / "one"
    LlamaConfig(**SMALL, intermediate_size=128, num_hidden_layers=1, num_key_value_heads=2).save_pretrained(one)
    code, out, err = _plan(capsys, one, "--zero-stage", 1)
    assert code == 0 and json.loads(out), err
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            LlamaConfig(**SMALL, intermediate_size=128, num_hidden_layers=4, num_key_value_heads=2))
    # every layout priced (the search itself prices only those that could rank), on two worker processes
    planner = Planner(model, Workload(seq=32, global_batch=8, dtype=torch.bfloat16), workers=2)
    hw, choice = a100(4), Choice(zero_stage=1, micro_batch=1)
    layouts = list(candidates(planner, hw, choice))
    planner.prefetch({key for layout in layouts for key in planner.profile_keys(layout, hw, exact=False)})
    planner.close()
    assert all(planner.step_time(layout, hw, exact=False) for layout in layouts)  # a failed profile raises
    assert search(planner, hw, choice).best
