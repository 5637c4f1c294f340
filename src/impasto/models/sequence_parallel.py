"""Context parallelism inside a transformer denoiser (``parallel.cp``, issue #32): the token
sequence of each sample split across the ranks of a group, as DeepSpeed-Ulysses does (Jacobs
et al. 2023, arXiv:2309.14509).

From the patch embedding to the final layer each of the ``n`` ranks holds one contiguous shard
of the sequence, ``[B, S/n, D]`` (the tokens, their positions and a pack's per-token sample
ids are split alike); norms, MLPs, modulation and residuals run on it without communication.
Inside each self-attention an all-to-all turns the shard's queries, keys and values
``[B, H, S/n, Dh]`` (every head) into the whole sequence for ``H/n`` of the heads
``[B, H/n, S, Dh]``; the attention kernel runs unchanged, with the masks and partitions of the
whole sequence (a pack's document mask, ST-DiT's frame and patch-position groups stay valid),
and the inverse all-to-all hands each rank its shard back with every head. Cross-attention
reads text every rank holds whole: without a mask (a dense batch) the query shard attends to it
as it is; under a mask (a pack: each sample its own text) the queries take the same all-to-all
and the keys and values are cut to the rank's ``H/n`` heads, so the mask's rows stay those of
the whole sequence. The last layer's output is gathered whole on every rank (all-gather), so
the loss and everything after it see one process's prediction.

Gradients. The weights are the same on every rank, and each rank's backward reaches them
through its shard only (the modulation, text and time embeddings too, which it computed whole
but used on its shard). The gather's backward sums the ranks' gradients of the output and gives
each rank its shard's (a reduce-scatter): every rank computed the same loss from the same
gathered output, so each holds ``n`` times its shard's share. The data-parallel average over
the data × cp ranks (FSDP shards and reduces over both, as torchtitan does) divides by ``n``
again: the sum of the shards' contributions, one process's gradient.

Ring mode (``parallel.cp_mode: ring``). A kernel over the whole sequence that says which
tokens see each other (:class:`~impasto.models.ring_attention.BlockDiagonal`: full attention,
a pack's document mask) runs as ring attention instead (:mod:`impasto.models.ring_attention`):
the queries stay on their rank, the key and value shards pass around the group, so no rank
holds the whole sequence's keys and values at once. Every other kernel (an
ST-DiT's spatial and temporal groups, a pack's cross-attention) keeps the all-to-all: local
groups of a few frames or patches do not pay for ``cp`` hops (the seed's hybrid).

This module never imports ``torch.distributed``: the exchanges are a :class:`Collectives`
(:mod:`impasto.train.context_parallel` makes one of a process group; the tests simulate one
with threads), so a model that holds a :class:`SequenceParallel` runs without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from impasto.models.ring_attention import BlockDiagonal, ring_self_attention

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]
"""``(q [B, H, Sq, Dh], k [B, H, Sk, Dh], v) -> [B, H, Sq, Dh]``: an attention kernel."""


class Collectives(Protocol):
    """Differentiable exchanges among the ``size`` ranks of a group (this process: ``rank``)."""

    rank: int
    size: int

    def all_to_all(self, chunks: Tensor) -> Tensor:
        """``[size, ...]``: chunk ``i`` goes to rank ``i``; returns ``[size, ...]``, chunk ``j``
        from rank ``j``. Backward: the gradients exchanged back the same way."""

    def all_gather(self, x: Tensor) -> Tensor:
        """Every rank's ``x``, stacked ``[size, ...]`` in rank order. Backward: the gradients
        summed over the ranks, each rank keeping its own slot (a reduce-scatter)."""

    def ring_shift(self, x: Tensor) -> Callable[[], Tensor]:
        """Start sending ``x`` to rank ``rank + 1`` and receiving rank ``rank - 1``'s (mod
        ``size``, same shape); the returned function waits and gives what arrived. Not
        differentiable (ring attention's backward runs its own ring)."""


MODES = ("ulysses", "ring")
"""``parallel.cp_mode``: how full self-attention crosses the group (module docstring)."""


class SequenceParallel:
    """One rank's view of a sequence split over a group (see the module docstring): what a
    denoiser calls to shard its sequence, to run attention over the whole of it, and to gather
    its output."""

    def __init__(self, collectives: Collectives, mode: str = "ulysses") -> None:
        assert mode in MODES, f"context-parallel mode {mode!r} is not one of {MODES}"
        self.collectives = collectives
        self.mode = mode

    @property
    def size(self) -> int:
        return self.collectives.size

    @property
    def rank(self) -> int:
        return self.collectives.rank

    def split(self, x: Tensor, dim: int) -> Tensor:
        """This rank's contiguous shard of ``x`` along ``dim`` (a slice: its backward puts the
        gradient in the shard's place, zero elsewhere)."""
        length = x.shape[dim]
        assert length % self.size == 0, f"{length} tokens do not split into {self.size} shards"
        shard = length // self.size
        return x.narrow(dim, self.rank * shard, shard)

    def gather(self, x: Tensor, dim: int) -> Tensor:
        """Every rank's shard, joined whole along ``dim`` (rank order)."""
        return self.collectives.all_gather(x).movedim(0, dim).flatten(dim, dim + 1)

    def heads_to_sequence(self, x: Tensor) -> Tensor:
        """``[B, H, S/n, Dh]`` (this rank's tokens, every head) → ``[B, H/n, S, Dh]`` (every
        token, this rank's heads: the ``rank``-th ``H/n`` of them)."""
        chunks = x.unflatten(1, (self.size, -1)).movedim(1, 0)  # [n, B, H/n, S/n, Dh]
        received = self.collectives.all_to_all(chunks.contiguous())  # j: rank j's tokens
        return received.movedim(0, 2).flatten(2, 3)

    def sequence_to_heads(self, x: Tensor) -> Tensor:
        """The inverse of :meth:`heads_to_sequence`: ``[B, H/n, S, Dh]`` → ``[B, H, S/n, Dh]``."""
        chunks = x.unflatten(2, (self.size, -1)).movedim(2, 0)  # [n, B, H/n, S/n, Dh]
        received = self.collectives.all_to_all(chunks.contiguous())  # j: rank j's heads
        return received.movedim(0, 1).flatten(1, 2)

    def own_heads(self, x: Tensor) -> Tensor:
        """This rank's ``H/n`` heads of ``x`` ``[B, H, L, Dh]``, which every rank holds whole."""
        heads = x.shape[1] // self.size
        return x.narrow(1, self.rank * heads, heads)

    def self_attention(self, attend: Attend) -> Attend:
        """``attend`` (a kernel over the whole sequence) run on this rank's shard: queries,
        keys and values exchanged in one all-to-all, the output in another; in ring mode, a
        :class:`~impasto.models.ring_attention.BlockDiagonal` kernel as ring attention."""
        if self.mode == "ring" and isinstance(attend, BlockDiagonal):
            return ring_self_attention(attend, self.collectives)

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            whole = self.heads_to_sequence(torch.cat([q, k, v]))
            return self.sequence_to_heads(attend(*whole.chunk(3)))

        return run

    def cross_attention(self, attend: Attend) -> Attend:
        """``attend`` (a kernel whose mask has a row per token of the whole sequence) run on
        this rank's query shard: keys and values (of text every rank holds) cut to its heads."""

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            out = attend(self.heads_to_sequence(q), self.own_heads(k), self.own_heads(v))
            return self.sequence_to_heads(out)

        return run
