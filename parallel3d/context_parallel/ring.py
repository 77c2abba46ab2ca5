"""Ring attention: keys and values travel around the context-parallel ring, queries stay home.

Layout (load-balanced causal): the sequence is cut into 2 x cp equal chunks and rank i keeps
chunks i and 2cp-1-i (``ring_chunks``; the batch cutter cuts tokens, labels and position ids
the same way). With a causal mask every rank then has the same number of visible query/key
pairs: against an earlier rank's keys only their head chunk is visible to both query chunks,
against a later rank's only the tail query chunk sees both key chunks.

Forward: each rank holds its chunks' q, k, v. In cp steps the k/v pair moves one rank on
(``batch_isend_irecv``: send to rank+1, receive from rank-1, started before the step's compute
so the transfer overlaps it), and each rank attends its queries to the k/v it holds, chunk pair
by chunk pair: a pair wholly masked (causal or sliding window, from the tokens' global
positions) is skipped, one wholly visible runs without a mask. The partial outputs are combined
with the online-softmax rule: out = sum_j exp(lse_j - lse) out_j with lse = logsumexp_j lse_j,
so the result is the softmax over the whole sequence.

Backward (``_RingAttention.backward``) is the flash-attention backward run around the ring
again: from the saved q, k, v, output and log-sum-exp each block's probabilities are recomputed,
dq accumulates at home, and the block's dk/dv accumulate in a buffer that travels with its k/v
and reaches the owner after cp hops. Exact (the same algebra as autograd through softmax), and
it keeps only O(s) per rank between forward and backward (q, k, v, out, lse), where autograd
through the ring would keep every block's probabilities: cp blocks of s x (S / cp) per head,
the whole s x S score matrix a rank's queries have, which is what context parallelism is for
avoiding.

What the model's own attention does and is reproduced: ``scaling`` (the model's softmax scale),
grouped-query attention without any limit (k/v keep their kv heads; each query group attends
to its kv head by broadcasting, and dk/dv sum over the group, so kv heads need not divide by
cp), sliding windows (``sliding_window`` w: key k is visible to query q iff q - w < k <= q,
transformers' ``sliding_window_overlay``), attention logit softcapping (scores ->
c tanh(scores / c), its derivative in the backward). Refused with the reason: attention dropout
above 0 (one process draws its mask over whole rows; the ring's blocks cannot reproduce it),
an added mask or position bias, attention sinks, non-causal layers.

Kernels: on the CPU, a block wholly visible or under exactly the causal mask (the diagonal
pairs) runs torch's fused flash-attention kernels, which return the block's log-sum-exp and
take the final one back in the backward (as torch's own context_parallel does); other blocks
(a window cutting through them, softcapping, other devices) run the blocked arithmetic here,
their query rows in tiles of ``_TILE_ELEMENTS`` scores so the transient memory stays bounded.
Arithmetic runs in the inputs' dtype, float32 for half precision inputs: k and v travel in their
own dtype (bf16 halves the bytes) and are upcast per step; dk/dv travel and accumulate in the
working dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parallel3d.context_parallel.mask_inputs import MaskInputs
from parallel3d.errors import ConfigError


def ring_chunks(rank: int, size: int) -> tuple[int, int]:
    """The two of the sequence's 2 x ``size`` chunks that cp rank ``rank`` keeps (head and tail)."""
    return rank, 2 * size - 1 - rank


def ring_index(rank: int, size: int, length: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions of cp rank ``rank``'s tokens in a sequence of ``length`` (its two chunks, in order)."""
    chunk = length // (2 * size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in ring_chunks(rank, size)])


_TILE_ELEMENTS = 1 << 22
"""Scores computed at once (16 MiB in float32): a block's query rows are taken in tiles of this
many scores, so the transient memory of a long chunk stays bounded (flash attention's tiling)."""


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None):
    """Scores [B, Hkv, g, s, t] of grouped queries q [B, Hkv, g, s, D] against k [B, Hkv, t, D];
    with softcapping also tanh(raw / c), which the backward's derivative needs."""
    raw = q @ k.unsqueeze(2).transpose(-1, -2) * scale
    if softcap is None:
        return raw, None
    capped = torch.tanh(raw / softcap)
    return capped * softcap, capped


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (rows that see nothing yet) as 0, so exp(x - lse) is 0 there, not NaN."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


class _Block:
    """One (query chunk, key chunk) pair, chunks as global position ranges [q0, q0 + n), [k0, k0 + m):
    ``skip`` when wholly masked; ``masked`` unless wholly visible (causal, inside the window).

    ``keys`` [B, S]: False at padded keys. ``void`` [B, S]: query rows that see no key at all
    (padding before them) and get, as under one process's eager kernel, uniform attention over
    every key of the sequence (see ``RingAttention``); a block holding such a row is never skipped."""

    def __init__(self, q0: int, k0: int, n: int, m: int, window: int | None, documents: torch.Tensor | None = None,
                 keys: torch.Tensor | None = None, void: torch.Tensor | None = None) -> None:
        self.q0, self.k0, self.window = q0, k0, window
        nearest, farthest = q0 - (k0 + m - 1), q0 + n - 1 - k0  # smallest and largest q - k in the pair
        inside = window if window is not None else farthest + 1
        self.skip = farthest < 0 or nearest >= inside
        self.masked = not self.skip and (nearest < 0 or farthest >= inside)
        self.causal = self.masked and q0 == k0 and n == m and farthest < inside  # the mask is exactly causal
        self.documents = self.keys = self.void = None
        if documents is not None and not self.skip:  # packed rows: a key is visible in its own document only
            self.documents = (documents[:, q0:q0 + n], documents[:, k0:k0 + m])
            self.skip = not bool((self.documents[0][:, :, None] == self.documents[1][:, None, :]).any())
            self.masked, self.causal = not self.skip, False
        if keys is not None and not bool(keys[:, k0:k0 + m].all()):  # padding among the keys
            self.keys = keys[:, None, None, None, k0:k0 + m]  # [B, 1, 1, 1, m]
            self.skip = self.skip or not bool(self.keys.any())
            self.masked, self.causal = not self.skip, False
        if void is not None and bool(void[:, q0:q0 + n].any()):
            self.void = void[:, None, None, q0:q0 + n, None]  # [B, 1, 1, n, 1]
            self.skip, self.masked, self.causal = False, True, False

    def tiles(self, rows: int, columns: int, heads: int):
        """Row ranges of at most ``_TILE_ELEMENTS`` scores, each with its mask (None: all visible) and
        its void rows (None: none), whose scores count as 0 for every key."""
        step = max(1, _TILE_ELEMENTS // max(1, columns * heads))
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            mask = void = None
            if self.masked:
                diff = (torch.arange(self.q0 + start, self.q0 + stop)[:, None]
                        - torch.arange(self.k0, self.k0 + columns)[None, :])
                mask = diff >= 0 if self.window is None else (diff >= 0) & (diff < self.window)
            if self.documents is not None:  # [B, 1, 1, rows, columns]
                same = self.documents[0][:, start:stop, None] == self.documents[1][:, None, :]
                mask = (same & mask.to(same.device))[:, None, None]
            if self.keys is not None:  # [B, 1, 1, rows, columns]
                mask = mask.to(self.keys.device) & self.keys
            if self.void is not None:
                void = self.void[:, :, :, start:stop]
                mask = mask.to(void.device) | void
            yield slice(start, stop), mask, void


def _masked_scores(scores: torch.Tensor, mask: torch.Tensor | None, void: torch.Tensor | None) -> torch.Tensor:
    """Scores with masked pairs at -inf and void rows at 0 (their gradient passes through unchanged,
    as through one process's eager kernel, which adds the dtype's minimum to every score of such a row)."""
    if mask is not None:
        scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    if void is not None:
        scores = scores.masked_fill(void.to(scores.device), 0.0)
    return scores


class _Ring:
    """The cp group's ring: one exchange sends to the next rank and receives from the previous."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.previous = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensors: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...], list]:
        """Begin passing ``tensors`` on (k and v, or their gradients: their head dimensions may differ,
        as in multi-head latent attention); returns the buffers the previous rank's arrive in and the works."""
        received = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors)  # contiguous
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.previous, self.group) for r in received]
        return received, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(received: tuple[torch.Tensor, ...], works: list) -> tuple[torch.Tensor, ...]:
        for work in works:
            work.wait()
        return received


class _Settings:
    """What one attention call needs besides tensors: the ring, the chunk length, the kernel's options."""

    def __init__(self, ring: _Ring, chunk: int, scale: float, window: int | None, softcap: float | None,
                 documents: torch.Tensor | None, keys: torch.Tensor | None = None,
                 void: torch.Tensor | None = None) -> None:
        self.ring, self.chunk, self.scale, self.window, self.softcap = ring, chunk, scale, window, softcap
        self.documents, self.keys, self.void = documents, keys, void

    def blocks(self, source: int) -> list[list[_Block]]:
        """blocks[a][b]: this rank's query chunk a against cp rank ``source``'s key chunk b."""
        size, n = self.ring.size, self.chunk
        return [[_Block(a * n, b * n, n, n, self.window, self.documents, self.keys, self.void)
                 for b in ring_chunks(source, size)]
                for a in ring_chunks(self.ring.rank, size)]


def _fused(q: torch.Tensor, v: torch.Tensor, block: _Block, settings: _Settings) -> bool:
    """Whether the block runs torch's fused CPU flash-attention kernels (which return the log-sum-exp
    and take it back in the backward): on the CPU, without softcapping, for a block wholly visible
    or under exactly the causal mask, with values as wide as the keys. Otherwise the blocked
    arithmetic below runs."""
    return (q.device.type == "cpu" and settings.softcap is None and (not block.masked or block.causal)
            and q.shape[-1] == v.shape[-1])


def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q [B, Hkv, g, s, D] as [B, Hq, s, D] and k, v repeated per query head, as the fused kernels take them."""
    groups = q.shape[2]
    if groups == 1:
        return q.squeeze(2), k, v
    return q.flatten(1, 2), k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def _forward_block(q, k, v, block: _Block, settings: _Settings):
    """Softmax-normalized output [B, Hkv, g, s, D] of one block and its log-sum-exp [B, Hkv, g, s]."""
    if _fused(q, v, block, settings):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *_heads(q, k, v), 0.0, block.causal, scale=settings.scale)
        return out.view(q.shape), lse.view(q.shape[:-1])
    outs, lses = [], []
    for rows, mask, void in block.tiles(q.shape[3], k.shape[2], q.shape[0] * q.shape[1] * q.shape[2]):
        scores, _ = _scores(q[:, :, :, rows], k, settings.scale, settings.softcap)
        scores = _masked_scores(scores, mask, void)
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.exp(scores - _finite(lse).unsqueeze(-1)) @ v.unsqueeze(2))
        lses.append(lse)
    return torch.cat(outs, dim=3), torch.cat(lses, dim=3)


def _backward_block(q, k, v, out, grad_out, lse, delta, block: _Block, settings: _Settings, dq, dk, dv) -> None:
    """Add one block's gradient to dq [B, Hkv, g, s, D] and dk, dv [B, Hkv, t, D] (flash attention's
    backward: P recomputed from the final log-sum-exp, dS = P (dP - rowsum(dO O)))."""
    if _fused(q, v, block, settings):
        dq_block, dk_block, dv_block = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.flatten(1, 2), *_heads(q, k, v), out.flatten(1, 2), lse.flatten(1, 2), 0.0, block.causal,
            scale=settings.scale)
        dq += dq_block.view(q.shape)
        dk += dk_block.unflatten(1, (k.shape[1], q.shape[2])).sum(2)
        dv += dv_block.unflatten(1, (k.shape[1], q.shape[2])).sum(2)
        return
    for rows, mask, void in block.tiles(q.shape[3], k.shape[2], q.shape[0] * q.shape[1] * q.shape[2]):
        scores, capped = _scores(q[:, :, :, rows], k, settings.scale, settings.softcap)
        scores = _masked_scores(scores, mask, void)
        p = torch.exp(scores - _finite(lse[:, :, :, rows]).unsqueeze(-1))  # rows that see no key: 0
        dv += (p.transpose(-1, -2) @ grad_out[:, :, :, rows]).sum(2)
        ds = p * (grad_out[:, :, :, rows] @ v.unsqueeze(2).transpose(-1, -2) - delta[:, :, :, rows].unsqueeze(-1))
        if capped is not None:
            ds = ds * (1 - capped * capped)
        dq[:, :, :, rows] += ds @ k.unsqueeze(2) * settings.scale
        dk += (ds.transpose(-1, -2) @ q[:, :, :, rows]).sum(2) * settings.scale


def _combine(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """The online-softmax rule: two partial results over disjoint keys -> their result over both."""
    total = torch.logaddexp(lse, block_lse)
    safe = _finite(total).unsqueeze(-1)
    return out * torch.exp(lse.unsqueeze(-1) - safe) + block_out * torch.exp(block_lse.unsqueeze(-1) - safe), total


def _chunks(t: torch.Tensor, dim: int) -> list[torch.Tensor]:
    return list(t.chunk(2, dim=dim))


class _RingAttention(torch.autograd.Function):
    """Exact ring attention; q [B, Hkv, g, s, D], k/v [B, Hkv, s, D] (this rank's two chunks)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, settings: _Settings):
        ring = settings.ring
        qs = _chunks(q, 3)
        out = [c.new_zeros(*c.shape[:-1], v.shape[-1]) for c in qs]  # values may be narrower than keys (MLA)
        lse = [torch.full(c.shape[:-1], float("-inf"), dtype=c.dtype, device=c.device) for c in qs]
        held, source = (k, v), ring.rank
        for step in range(ring.size):
            pending = ring.start(held) if step < ring.size - 1 else None
            ks, vs = _chunks(held[0].to(q.dtype), 2), _chunks(held[1].to(q.dtype), 2)  # sent as given, upcast here
            for a, row in enumerate(settings.blocks(source)):
                for b, block in enumerate(row):
                    if not block.skip:
                        out[a], lse[a] = _combine(out[a], lse[a], *_forward_block(qs[a], ks[b], vs[b], block, settings))
            if pending is not None:
                held, source = _Ring.finish(*pending), (source - 1) % ring.size
        output, log_sum_exp = torch.cat(out, dim=3), torch.cat(lse, dim=3)
        ctx.save_for_backward(q, k, v, output, log_sum_exp)
        ctx.settings = settings
        return output

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        settings = ctx.settings
        ring = settings.ring
        qs, outs, dos, lses = _chunks(q, 3), _chunks(out, 3), _chunks(grad_out, 3), _chunks(lse, 3)
        deltas = _chunks((grad_out * out).sum(-1), 3)
        dqs = [torch.zeros_like(c) for c in qs]
        held, source = (k, v), ring.rank
        # dk, dv of the block held, summed over the ranks it has visited, in the working dtype
        travelling = (torch.zeros_like(k, dtype=q.dtype), torch.zeros_like(v, dtype=q.dtype))
        for step in range(ring.size):
            pending = ring.start(held) if step < ring.size - 1 else None
            ks, vs = _chunks(held[0].to(q.dtype), 2), _chunks(held[1].to(q.dtype), 2)
            dks, dvs = _chunks(travelling[0], 2), _chunks(travelling[1], 2)  # views: += fills travelling
            for a, row in enumerate(settings.blocks(source)):
                for b, block in enumerate(row):
                    if not block.skip:
                        _backward_block(qs[a], ks[b], vs[b], outs[a], dos[a], lses[a], deltas[a], block, settings,
                                        dqs[a], dks[b], dvs[b])
            if pending is not None:  # the k/v exchange first: one message at a time on each link
                held, source = _Ring.finish(*pending), (source - 1) % ring.size
            travelling = _Ring.finish(*ring.start(travelling))  # dk, dv follow their block (home after cp hops)
        return torch.cat(dqs, dim=3), travelling[0].to(k.dtype), travelling[1].to(v.dtype), None


class RingAttention:
    """The attention function of one model under ring context parallelism.

    ``calls`` counts the attention calls since the last ``reset`` and ``windowed`` those given a
    sliding window, so a forward whose layers did not all come here, or whose sliding layers did
    not pass their window, is caught rather than silently wrong.

    Padding: a query row that sees no key (left padding: the padded tokens before the first real
    one) gets what the model's own kernel (``inner``) gives it under one process: sdpa outputs 0
    there (and no gradient); eager adds the dtype's minimum to every score of the row, so its
    softmax is uniform over all the sequence's keys and its gradient passes through to q and k:
    the ring computes such rows over every block with their scores taken as 0 (``_Block.void``).
    The row's output feeds the prediction of the first real token, so the loss depends on it.
    """

    method = "ring"

    def __init__(self, group: dist.ProcessGroup, model_type: str, inner: str = "sdpa") -> None:
        self.group = group
        self.inner = inner
        self.ring = _Ring(group)
        self.size = self.ring.size
        self.model_type = model_type
        self.calls = 0
        self.windowed = 0
        self.inputs = MaskInputs()
        """The micro-batch's padding and packed documents (set by the batch cutter). Every rank holds
        the whole rows, so a block's key padding is read at the global positions of the keys it
        holds, not sent with them."""

    def reset(self) -> None:
        self.calls = self.windowed = 0

    def _void(self, window: int | None) -> torch.Tensor | None:
        """[B, S]: the query rows that see no key (none, or not eager: None); see the class docstring."""
        if self.inputs.padding is None or self.inner != "eager":
            return None
        seen = self.inputs.padding.long().cumsum(-1)  # keys visible to each query without a window
        if window is not None:  # minus those at or before q - w
            seen = seen - nn.functional.pad(seen, (window, 0))[:, :seen.shape[1]]
        void = seen == 0
        return void if bool(void.any()) else None

    def _refuse(self, reason: str) -> ConfigError:
        return ConfigError(f"context_parallel (ring) cannot run {self.model_type}'s attention: {reason}")

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, sliding_window: int | None = None, softcap: float | None = None,
                 dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """query [B, Hq, s, D], key/value [B, Hkv, s, D] for this rank's s = S / cp tokens (its two
        chunks); returns [B, s, Hq, D] as transformers' attention functions do (no weights)."""
        self.calls += 1
        if attention_mask is not None or kwargs.get("position_bias") is not None:
            raise self._refuse("it adds its own mask or position bias (alibi, custom masks) to the attention scores")
        if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
            raise self._refuse("attention sinks")
        if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
            raise self._refuse("a non-causal (bidirectional) attention layer")
        if dropout:
            raise self._refuse(f"attention dropout {dropout}: one process draws its mask over whole rows of the "
                               "scores, which the ring's blocks cannot reproduce; set attention_dropout 0")
        batch, heads, length, dim = query.shape
        kv_heads = key.shape[1]
        if heads % kv_heads:
            raise self._refuse(f"{heads} query heads are not a multiple of its {kv_heads} key/value heads")
        if sliding_window is not None:
            self.windowed += 1
        work = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
        problem = self.inputs.problem(batch, length * self.size)
        if problem is not None:
            raise self._refuse(problem)
        settings = _Settings(self.ring, length // 2, dim ** -0.5 if scaling is None else scaling, sliding_window,
                             softcap, self.inputs.documents, self.inputs.padding, self._void(sliding_window))
        grouped = query.to(work).reshape(batch, kv_heads, heads // kv_heads, length, dim)
        output = _RingAttention.apply(grouped, key, value, settings)  # k, v travel in their own dtype
        output = output.reshape(batch, heads, length, value.shape[-1])
        return output.transpose(1, 2).contiguous().to(query.dtype), None
