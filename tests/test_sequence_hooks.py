"""Which block inputs sequence parallelism cuts to a rank's part, and which modules it runs on the
whole sequence (``parallel3d/tensor_parallel/sequence.py``), without processes."""

from __future__ import annotations

import torch
from torch import nn

from parallel3d.tensor_parallel.sequence import sequence_mixers, token_input_hook


class _Block(nn.Module):
    def forward(self, hidden_states, per_layer_input=None, attention_mask=None, mamba_attention_mask=None,
                position_ids=None, encoder_hidden_states=None, **kwargs):
        return hidden_states


def test_per_token_inputs_are_cut_and_the_mixers_inputs_stay_whole():
    world, batch, part, width = 2, 3, 4, 5
    whole = part * world
    block = _Block()
    seen = {}
    block.register_forward_pre_hook(token_input_hook(block, world, lambda x, n: x.narrow(1, 0, n)), with_kwargs=True)
    block.register_forward_pre_hook(lambda m, a, k: seen.update(args=a, kwargs=k), with_kwargs=True)
    block(torch.zeros(batch, part, width), torch.zeros(batch, whole, 7),  # positional per-token input
          attention_mask=torch.ones(batch, whole), mamba_attention_mask=torch.ones(batch, whole),
          position_ids=torch.zeros(batch, whole, dtype=torch.long), encoder_hidden_states=torch.zeros(batch, whole, width),
          input_ids=torch.zeros(batch, whole, dtype=torch.long),  # through **kwargs
          other=torch.zeros(batch + 1, whole))  # not [batch, ...]: left alone
    shapes = {k: tuple(v.shape) for k, v in seen["kwargs"].items()}
    assert tuple(seen["args"][1].shape) == (batch, part, 7)
    assert shapes == {"attention_mask": (batch, whole), "mamba_attention_mask": (batch, whole),
                      "position_ids": (batch, whole), "encoder_hidden_states": (batch, whole, width),
                      "input_ids": (batch, part), "other": (batch + 1, whole)}


class _Attention(nn.Module):
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None):
        return hidden_states


class _Mixer(nn.Module):
    def forward(self, hidden_states, cache_params=None):
        return hidden_states


class _MLP(nn.Module):
    def forward(self, x):
        return x


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn, self.mamba, self.mlp, self.norm = _Attention(), _Mixer(), _MLP(), nn.LayerNorm(4)


class _Model(nn.Module):
    _no_split_modules = ["_Layer"]

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([_Layer(), _Layer()])

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens


def test_mixers_are_the_token_mixing_modules_outside_the_split_regions():
    """An attention the plan splits is a region and gathers on its own; an unsplit one, a
    state-space mixer, run whole; MLPs and norms work token by token and stay on the rank's part."""
    model = _Model()
    assert sequence_mixers(model, {"layers.0.self_attn"}) == ["layers.0.mamba", "layers.1.self_attn", "layers.1.mamba"]
