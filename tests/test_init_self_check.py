"""The init replay checks itself against eager construction once per process and family, so a
torch that changed what it relies on is refused before a model trains from other values.

Each test breaks one such detail the way a torch release could (an init function that skips
meta tensors by their device, a draw that advances the generator differently) and sees the
refusal, naming the tensor; a torch lacking a private detail is refused by its name.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from models import init_execute, init_self_check, init_trace
from models.init_programs import MaterializeError
from models.init_self_check import ReplaySelfCheckError
from models.materialize import InitReplay
from parallel3d.errors import ConfigError
from parallel3d.build.meta_init import take_source

_CONFIG = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1)


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(init_self_check, "_CHECKED", {})


def _meta_llama() -> torch.nn.Module:
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**_CONFIG))


def _skips_meta_by_device(init):
    """``init`` as a torch release could write it: skipping meta tensors by their device (the
    replay answers ``is_meta`` with False so that torch's own init functions draw)."""
    def changed(tensor, *args, **kwargs):
        if tensor.device.type == "meta":
            return tensor
        return init(tensor, *args, **kwargs)
    return changed


def test_an_init_function_that_skips_meta_tensors_otherwise_is_caught(monkeypatch):
    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", _skips_meta_by_device(torch.nn.init.kaiming_uniform_))
    with pytest.raises(ReplaySelfCheckError, match=r"under torch .*: for torch's own layers in torch.float32, built "
                                                   r"on the meta device, it refuses \(tensors without an initial "
                                                   r"value: 1.weight, 4.weight"):
        InitReplay(_meta_llama())


def test_a_draw_that_advances_the_generator_otherwise_is_caught(monkeypatch):
    """The replay draws the values nobody asked for into scratch so the generator moves as in eager;
    here it does not (as if a draw consumed the stream differently): the values after differ."""
    monkeypatch.setattr(init_execute.Executor, "_draw", lambda self, rec, func, args, kwargs: None)
    with pytest.raises(ReplaySelfCheckError, match="differs|ends in another state"):
        InitReplay(_meta_llama())


def test_a_family_specific_mismatch_names_the_family(monkeypatch):
    """Only Llama's init breaks (its _init_weights' normal_ skips meta by device): torch's own
    layers still pass, the tiny Llama does not."""
    from transformers import initialization

    monkeypatch.setattr(initialization, "normal_", _skips_meta_by_device(initialization.normal_))
    with pytest.raises(ReplaySelfCheckError, match=r"for a tiny LlamaForCausalLM \(model_type='llama', "
                                                   r"torch.float32\)"):
        InitReplay(_meta_llama())


def test_the_refusal_reaches_initialize_as_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", _skips_meta_by_device(torch.nn.init.kaiming_uniform_))
    with pytest.raises(ConfigError, match="cannot initialize the meta-device model: the init replay does not "
                                          "reproduce eager construction"):
        take_source(_meta_llama())


def test_a_missing_private_detail_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(init_trace, "_IS_META", None)
    with pytest.raises(MaterializeError, match=r"lacks what the init replay relies on: torch._C.TensorBase.is_meta"):
        InitReplay(_meta_llama())


def test_checked_once_per_process_and_family(monkeypatch):
    seen = []
    compare = init_self_check._compare
    monkeypatch.setattr(init_self_check, "_compare",
                        lambda build, what, cls, strict: seen.append(what) or compare(build, what, cls, strict))
    torch.manual_seed(0)
    InitReplay(_meta_llama())
    InitReplay(_meta_llama())
    assert seen == ["torch's own layers in torch.float32",
                    "a tiny LlamaForCausalLM (model_type='llama', torch.float32)"]
    with torch.device("meta"):
        other = torch.nn.Sequential(torch.nn.Linear(4, 4)).double()
    InitReplay(other)
    assert seen[2:] == ["torch's own layers in torch.float64"]


def test_the_self_check_leaves_the_generator_alone():
    meta = _meta_llama()
    torch.manual_seed(3)
    state = torch.get_rng_state()
    InitReplay(meta)
    assert torch.equal(torch.get_rng_state(), state)


class _OwnInit(LlamaForCausalLM):
    """A user's own init: orthogonal projections and a branch on a drawn value."""

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, torch.nn.Linear) and module.weight.shape[0] == module.weight.shape[1]:
            torch.nn.init.orthogonal_(module.weight)
            if module.weight[0, 0] > 0:
                module.weight.data.mul_(0.5)


def test_a_custom_init_is_replayed_as_eager():
    """The replay runs the model's own construction, whatever its init does; the self-check
    builds the user's class too."""
    from models.tensor_source import whole

    torch.manual_seed(11)
    eager = _OwnInit(LlamaConfig(**_CONFIG))
    with torch.device("meta"):
        meta = _OwnInit(LlamaConfig(**_CONFIG))
    got = dict(InitReplay(meta, seed=11).read(whole(dict(eager.named_parameters()))))
    for name, p in eager.named_parameters():
        assert torch.equal(got[name][0], p.detach()), name
    assert (_OwnInit, "llama", torch.float32) in init_self_check._CHECKED
