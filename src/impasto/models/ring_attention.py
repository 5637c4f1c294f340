"""Ring attention (``parallel.cp_mode: ring``, issue #32): self-attention over a sequence
split across the ``n`` ranks of a context-parallel group without ever holding it whole (Liu et
al. 2023, "Ring Attention with Blockwise Transformers", arXiv:2310.01889; the layout of
ring-flash-attention and torchtitan's context parallelism).

Each rank keeps its query shard ``[B, H, S/n, Dh]`` and passes its key/value shard around the
ring: at step ``i`` it holds the keys and values of rank ``(rank - i) mod n``, attends to them
and sends them on to rank ``rank + 1`` (the next transfer starts before the step's work, so
they overlap where the transport is asynchronous). The partial outputs merge by the
log-sum-exp rule of the online softmax (Milakov & Gimelshein 2018; Flash Attention):

    lse = log(e^lse_a + e^lse_b),   out = e^(lse_a - lse)·out_a + e^(lse_b - lse)·out_b.

Backward (:class:`_RingAttention`) runs the ring again with Flash Attention's gradient of one
block, from the whole row's output ``O`` and log-sum-exp ``L`` saved by forward:
``P = exp(q·kᵀ·scale - L)``, ``dV += Pᵀ·dO``, ``dS = P ⊙ (dO·vᵀ - rowsum(dO ⊙ O))``,
``dQ += dS·k·scale``, ``dK += dSᵀ·q·scale``; the ``dK``/``dV`` accumulators travel with
their key/value shard and arrive home after ``n`` hops. As with the all-to-all, the gradient
of a rank's keys and values sums what every rank's queries made of them.

Masks: a :class:`BlockDiagonal` kernel says which tokens see each other (a pack's document
ids, padding a group of its own). Every rank knows the ids of the whole sequence, so nothing
but keys and values travels: a block attends under ``ids_q[:, None] == ids_k[None, :]``, and a
block whose shards share no group is skipped (known on the host from the groups' lengths, no
sync), which for packs of many short samples removes most of the work.

Why hand-written: ``torch.distributed.tensor.experimental.context_parallel`` (torch 2.14)
rings only the CUDA SDPA kernels (flash, efficient, cuDNN: not the CPU's), refuses an
``attn_bias`` ("not supported yet"), and its FlexAttention path all-gathers the keys and
values instead of passing them around. The blocks here are plain matmuls and a masked
softmax in float32, on any device: each step holds one ``(S/n)²`` score block per head (what
the ``sdpa`` kernel holds for the whole sequence), not a fused kernel's tiles.

Like :mod:`impasto.models.sequence_parallel`, this module never imports
``torch.distributed``: the ring's hop is :meth:`Collectives.ring_shift
<impasto.models.sequence_parallel.Collectives.ring_shift>`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from impasto.models.sequence_parallel import Attend, Collectives


@dataclass(frozen=True, eq=False)
class BlockDiagonal:
    """An attention kernel over a whole sequence in which token ``i`` sees key ``j`` where
    ``groups[i] == groups[j]`` (``groups`` ``[S]``, contiguous runs; None: every key): what
    ring attention needs to run the same attention on shards. ``lengths``: the runs' lengths
    in order, covering the sequence (None: unknown; every block is computed). Called, it is
    ``attend``."""

    attend: Attend
    groups: Tensor | None = None
    lengths: tuple[int, ...] | None = None

    def __call__(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        return self.attend(query, key, value)


def shared_blocks(lengths: Sequence[int] | None, shards: int) -> list[list[bool]]:
    """``[i][j]``: whether a run of ``lengths`` has tokens in both shard ``i`` and shard ``j``
    of ``shards`` equal shards (all True where ``lengths`` is None)."""
    if lengths is None:
        return [[True] * shards for _ in range(shards)]
    total = sum(lengths)
    assert total % shards == 0, f"{total} tokens do not split into {shards} shards"
    size, start = total // shards, 0
    shared = [[i == j for j in range(shards)] for i in range(shards)]
    for length in lengths:
        if length:
            touched = range(start // size, (start + length - 1) // size + 1)
            for i in touched:
                for j in touched:
                    shared[i][j] = True
        start += length
    return shared


# -- one block ---------------------------------------------------------------------------
def _scores(q: Tensor, k: Tensor, allowed: Tensor | None, scale: float) -> Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    return scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))


def block_forward(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """Softmax attention of ``q`` ``[B, H, Sq, Dh]`` over one block of keys and values
    ``[B, H, Sk, Dh]`` under ``allowed`` ``[Sq, Sk]`` (None: all): the output and the
    log-sum-exp of each row ``[B, H, Sq]`` (-inf and a zero output for a row that sees none)."""
    scores = _scores(q, k, allowed, scale)
    lse = torch.logsumexp(scores, -1)
    finite = lse.masked_fill(lse == float("-inf"), 0.0)  # exp(-inf - 0) = 0: no NaN
    return torch.matmul(torch.exp(scores - finite[..., None]), v), lse


def merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """The online softmax's merge of two partial results over disjoint keys (module
    docstring); rows that have seen no key yet (lse -inf on both sides) stay zero."""
    total = torch.logaddexp(lse, block_lse)
    finite = total.masked_fill(total == float("-inf"), 0.0)
    weight, block_weight = torch.exp(lse - finite), torch.exp(block_lse - finite)
    return out * weight[..., None] + block_out * block_weight[..., None], total


def block_backward(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float,
    lse: Tensor, grad_out: Tensor, delta: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """One block's share of the gradients of q, k and v, given the whole rows' log-sum-exp
    ``lse`` and ``delta = rowsum(dO ⊙ O)`` ``[B, H, Sq]`` (Flash Attention's backward)."""
    probs = torch.exp(_scores(q, k, allowed, scale) - lse[..., None])  # masked: exp(-inf) = 0
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out)
    grad_scores = probs * (torch.matmul(grad_out, v.transpose(-1, -2)) - delta[..., None])
    grad_q = torch.matmul(grad_scores, k) * scale
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q) * scale
    return grad_q, grad_k, grad_v


# -- the ring ----------------------------------------------------------------------------
class _Ring:
    """What one rank's pass around the ring needs: its shard's place, each block's mask and
    whether it has any work."""

    def __init__(self, collectives: Collectives, kernel: BlockDiagonal, shard: int) -> None:
        self.collectives = collectives
        self.size, self.rank = collectives.size, collectives.rank
        self.shard = shard
        self.groups = kernel.groups
        self.shared = shared_blocks(kernel.lengths, self.size)[self.rank]

    def source(self, step: int) -> int:
        """The rank whose keys and values this rank holds at ``step``."""
        return (self.rank - step) % self.size

    def allowed(self, source: int) -> Tensor | None:
        if self.groups is None:
            return None
        own = self.groups.narrow(0, self.rank * self.shard, self.shard)
        theirs = self.groups.narrow(0, source * self.shard, self.shard)
        return own[:, None] == theirs[None, :]


def _float(*tensors: Tensor) -> list[Tensor]:
    return [t.float() for t in tensors]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ring: _Ring) -> Tensor:  # noqa: ANN001
        scale = 1.0 / math.sqrt(q.shape[-1])
        with torch.autocast(q.device.type, enabled=False):
            query, keys = q.float(), torch.stack(_float(k, v))  # [2, B, H, S/n, Dh]: one message
            out = torch.zeros_like(query)
            lse = torch.full(query.shape[:-1], float("-inf"), device=q.device)
            for step in range(ring.size):
                source = ring.source(step)
                arriving = ring.collectives.ring_shift(keys) if step < ring.size - 1 else None
                if ring.shared[source]:
                    block = block_forward(query, keys[0], keys[1], ring.allowed(source), scale)
                    out, lse = merge(out, lse, *block)
                if arriving is not None:
                    keys = arriving()
        ctx.ring, ctx.scale = ring, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # noqa: ANN001, ANN205
        ring, scale = ctx.ring, ctx.scale
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            query, grad_out = q.float(), grad_out.float()
            delta = (grad_out * out).sum(-1)
            keys = torch.stack(_float(k, v))
            grads = torch.zeros_like(keys)  # dK, dV of the shard held: they travel with it
            grad_q, passing = torch.zeros_like(query), None
            for step in range(ring.size):
                source = ring.source(step)
                arriving = ring.collectives.ring_shift(keys) if step < ring.size - 1 else None
                block = None
                if ring.shared[source]:
                    grad_q_block, *block = block_backward(
                        query, keys[0], keys[1], ring.allowed(source), scale, lse, grad_out, delta
                    )
                    grad_q = grad_q + grad_q_block
                if passing is not None:  # the held shard's accumulator, sent during the work
                    grads = passing()
                if block is not None:
                    grads = grads + torch.stack(block)
                passing = ring.collectives.ring_shift(grads)  # n hops: home with its shard
                if arriving is not None:
                    keys = arriving()
            grads = passing()
        return grad_q.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None


@torch.compiler.disable  # P2P requests and their waits: run eagerly inside compiled blocks
def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, kernel: BlockDiagonal, collectives: Collectives
) -> Tensor:
    """``kernel``'s attention of this rank's query shard ``q`` ``[B, H, S/n, Dh]`` over the
    whole sequence, whose key and value shards ``k``, ``v`` (this rank's, like ``q``) pass
    around the ring of ``collectives``."""
    ring = _Ring(collectives, kernel, q.shape[2])
    return _RingAttention.apply(q, k, v, ring)


def ring_self_attention(kernel: BlockDiagonal, collectives: Collectives) -> Callable[..., Tensor]:
    """:func:`ring_attention` as an attention kernel over shards."""
    return lambda q, k, v: ring_attention(q, k, v, kernel, collectives)
