"""Context parallelism's price per attention layer: the bytes a cp rank sends, its messages, the
buffers it holds, and their time on a link (docs/context_parallel.md, "Cost").

For one micro-batch of ``b`` sequences of ``S`` tokens on a cp group of ``cp`` ranks, each rank
holds ``s = S / cp`` tokens; ``h_q`` and ``h_kv`` are the heads one tensor-parallel rank holds,
``d`` the head dimension, ``e`` bytes per element of the activations (``w`` of the ring's working
dtype: float32 for half-precision activations).

* Ulysses (``parallel3d/context_parallel/ulysses.py``): forward, four all-to-alls: q
  (``b s h_q d``), k and v (``b s h_kv' d`` each, ``h_kv' = cp`` when the kv heads are repeated
  up to cp) and the output (``b s h_q d``); a rank keeps 1/cp of each and sends the rest. The
  backward exchanges the four gradients the same way.
* Ring (``parallel3d/context_parallel/ring.py``): forward, cp - 1 hops of the k/v pair (``2 b s
  h_kv d`` at ``e``); backward, cp - 1 hops of k/v again and cp hops of their gradients at ``w``
  (the travelling dk/dv come home). Held besides the model's own activations: for backward, the
  layer's output and log-sum-exp at ``w`` (q, k, v are the projections' own); in flight, the k/v
  pair held and the one arriving, and in the backward the travelling dk/dv too.

The planner's layout search prices cp from the profile of a cp rank's pass, which runs the
engine's cp attention on a fake cp group (``profile.profile_pass``): its exchanges are counted
there. These closed forms are what ``zero3d plan --context-parallel`` prints next to its table
for the chosen layout (checked against the bytes the attention functions send,
tests/test_ring_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel3d.context_parallel.model import ulysses_head_problem
from parallel3d.planner.hardware import Link


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer as one tensor-parallel rank holds it."""

    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config, tp: int = 1) -> AttentionShape:
        """From a transformers text config (a kv head is replicated when there are fewer than tp)."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(heads // tp, kv_heads // tp if kv_heads >= tp else 1, head_dim)


@dataclass(frozen=True)
class ContextCost:
    """What one cp rank sends per attention layer and micro-batch, and what it holds."""

    method: str
    cp: int
    forward_bytes: int
    backward_bytes: int
    forward_messages: int
    """Point-to-point hops (ring) or all-to-alls (Ulysses) in the forward."""
    backward_messages: int
    saved_bytes: int
    """Held from forward to backward by the cp attention itself (ring: output and log-sum-exp)."""
    buffer_bytes: int
    """Held while the layer runs (ring: k/v held and arriving, the travelling dk/dv)."""

    def seconds(self, link: Link) -> tuple[float, float]:
        """Forward and backward wire time on ``link``: per message its latency (an all-to-all's cp - 1
        steps), plus the bytes at the link's bandwidth. Ring's hops overlap the blocks' compute, so
        this is an upper bound on what it exposes."""
        steps = 1 if self.method == "ring" else self.cp - 1
        return tuple(messages * steps * link.latency + sent / link.bandwidth
                     for messages, sent in ((self.forward_messages, self.forward_bytes),
                                            (self.backward_messages, self.backward_bytes)))


def context_cost(method: str, cp: int, seq: int, micro_batch: int, shape: AttentionShape,
                 element_bytes: int) -> ContextCost:
    """The price of one attention layer at context-parallel size ``cp`` (module docstring)."""
    local = micro_batch * seq // cp
    if method == "ring":
        work = max(element_bytes, 4)  # half-precision activations: the ring works in float32
        pair = 2 * local * shape.kv_heads * shape.head_dim  # elements of k and v
        forward = (cp - 1) * pair * element_bytes
        return ContextCost("ring", cp, forward, forward + cp * pair * work, cp - 1, 2 * cp - 1, saved_bytes=local * shape.heads * (shape.head_dim + 1) * work,
                           buffer_bytes=2 * pair * element_bytes + pair * work)
    kv_heads = max(shape.kv_heads, cp)
    exchanged = local * (2 * shape.heads + 2 * kv_heads) * shape.head_dim * element_bytes
    sent = exchanged * (cp - 1) // cp
    return ContextCost("ulysses", cp, sent, sent, 4, 4, saved_bytes=0, buffer_bytes=exchanged)


def context_table(config, cp: int, seq: int, micro_batch: int, tp: int, element_bytes: int, link: Link) -> str:
    """``zero3d plan --context-parallel``'s lines: per attention layer and micro-batch, each
    method's bytes sent per rank, wire time and buffers, or why Ulysses cannot run."""
    shape = AttentionShape.of(config, tp)
    layers = config.num_hidden_layers
    lines = [f"context parallelism {cp} (per rank, per attention layer and micro-batch of {micro_batch} x {seq} "
             f"tokens; {layers} layers; for the #1 layout's tp and micro-batch, either method):",
             f"{'method':9}{'sent fwd MB':>12}{'sent bwd MB':>12}{'wire fwd ms':>12}{'wire bwd ms':>12}"
             f"{'held MB':>9}{'buffers MB':>11}"]
    for method in ("ulysses", "ring"):
        problem = ulysses_head_problem(shape.heads, shape.kv_heads, cp) if method == "ulysses" else None
        if problem is not None:
            lines.append(f"{method:9}refused: {problem}")
            continue
        cost = context_cost(method, cp, seq, micro_batch, shape, element_bytes)
        forward, backward = cost.seconds(link)
        lines.append(f"{method:9}{cost.forward_bytes / 1e6:12.2f}{cost.backward_bytes / 1e6:12.2f}"
                     f"{forward * 1e3:12.3f}{backward * 1e3:12.3f}{cost.saved_bytes / 1e6:9.2f}"
                     f"{cost.buffer_bytes / 1e6:11.2f}")
    if seq % (2 * cp):
        lines.append(f"ring needs the sequence length to divide by 2 x {cp}; {seq} does not")
    return "\n".join(lines)
