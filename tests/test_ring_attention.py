"""Ring attention (``parallel.cp_mode: ring``, issue #32).

In one process: the ring's math (each query shard's blocks merged by the log-sum-exp rule in
ring order, and the gradients accumulated block by block as they travel) equals plain SDPA
and its autograd gradients, with and without a document mask; the blocks a pack lets skip
are those its mask leaves empty; and the autograd Function itself, on a group of threads
(:func:`test_context_parallel.on_threads`), predicts and differentiates like one process.
The DiT under ring mode is in tests/test_context_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_context_parallel import on_threads
from torch import Tensor

from impasto.models.ring_attention import (
    BlockDiagonal,
    block_backward,
    block_forward,
    merge,
    shared_blocks,
)
from impasto.models.sequence_parallel import SequenceParallel

# 4 shards of 6 tokens; runs 3, 9, 3, 4 and 5 padding: rows of a block that see none of its
# keys (shard 0's first 3 in shard 1's block) merge a log-sum-exp of -inf
RUNS = (3, 9, 3, 4, 5)
SHARDS = 4


def ids_of(runs: tuple[int, ...]) -> Tensor:
    return torch.repeat_interleave(torch.arange(len(runs)), torch.tensor(runs))


def qkv(length: int = 24, seed: int = 0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, length, 8, generator=generator, dtype=torch.float64)
            for _ in range(3)]  # fmt: skip


def reference(q: Tensor, k: Tensor, v: Tensor, ids: Tensor | None, grad_out: Tensor):
    """Plain SDPA over the whole sequence and the autograd gradients of ``<out, grad_out>``."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    mask = None if ids is None else ids[:, None] == ids[None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    (out * grad_out).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("masked", [False, True], ids=["dense", "document-mask"])
def test_the_ring_math_over_shards_equals_plain_attention(masked):
    """Simulated ring: query shard r meets key shards r, r-1, ... (as they arrive), merged by
    log-sum-exp; backward walks the same order, dK/dV summed over the query shards."""
    q, k, v = qkv()
    grad_out = torch.randn_like(q)
    ids = ids_of(RUNS) if masked else None
    want = reference(q, k, v, ids, grad_out)
    scale, size = 8**-0.5, 24 // SHARDS

    def shard(t: Tensor, i: int, dim: int = -2) -> Tensor:
        return t.narrow(dim, i * size, size)

    def allowed(i: int, j: int) -> Tensor | None:
        return None if ids is None else shard(ids, i, 0)[:, None] == shard(ids, j, 0)[None, :]

    outs, lses = [], []
    for rank in range(SHARDS):
        out = torch.zeros_like(shard(q, rank))
        lse = torch.full(out.shape[:-1], float("-inf"), dtype=q.dtype)
        for step in range(SHARDS):
            source = (rank - step) % SHARDS
            block = block_forward(shard(q, rank), shard(k, source), shard(v, source),
                                  allowed(rank, source), scale)  # fmt: skip
            out, lse = merge(out, lse, *block)
        outs.append(out)
        lses.append(lse)
    torch.testing.assert_close(torch.cat(outs, -2), want[0], rtol=1e-10, atol=1e-12)

    grad_q, grad_k, grad_v = (torch.zeros_like(t) for t in (q, k, v))
    for rank in range(SHARDS):
        rows = slice(rank * size, (rank + 1) * size)
        delta = (shard(grad_out, rank) * outs[rank]).sum(-1)
        for step in range(SHARDS):
            source = (rank - step) % SHARDS
            keys = slice(source * size, (source + 1) * size)
            dq, dk, dv = block_backward(
                shard(q, rank), shard(k, source), shard(v, source), allowed(rank, source),
                scale, lses[rank], shard(grad_out, rank), delta,
            )  # fmt: skip
            grad_q[..., rows, :] += dq
            grad_k[..., keys, :] += dk
            grad_v[..., keys, :] += dv
    for got, expected in zip((grad_q, grad_k, grad_v), want[1:], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_shared_blocks_are_the_blocks_the_mask_does_not_empty():
    """Runs of a pack → which (query shard, key shard) blocks have work, equal to the mask's
    blocks that hold any True; the worked example: runs 3, 9, 3, 4, 5 over 4 shards of 6."""
    assert shared_blocks(RUNS, SHARDS) == [
        [True, True, False, False],
        [True, True, False, False],
        [False, False, True, True],
        [False, False, True, True],
    ]
    generator = torch.Generator().manual_seed(3)
    for _ in range(20):
        cuts = torch.randperm(31, generator=generator)[:5].add(1).sort().values.tolist()
        runs = tuple(b - a for a, b in zip([0, *cuts], [*cuts, 32], strict=True))
        ids = ids_of(runs)
        mask = (ids[:, None] == ids[None, :]).reshape(4, 8, 4, 8).any(3).any(1)
        assert shared_blocks(runs, 4) == mask.tolist(), runs
    assert shared_blocks(None, 3) == [[True] * 3] * 3


@pytest.mark.parametrize("size,masked", [(2, True), (4, True), (3, False)])
def test_ring_attention_on_ranks_predicts_and_differentiates_like_one_process(size, masked):
    """The autograd Function on ``size`` threads (a ring of P2P hops): each rank's output
    shard and its q, k, v gradients are the slices of plain attention's (float32)."""
    q, k, v = (t.float() for t in qkv(length=24, seed=size))
    grad_out = torch.randn_like(q)
    ids = ids_of(RUNS) if masked else None
    want = reference(q, k, v, ids, grad_out)
    kernel = BlockDiagonal(lambda *args: None, ids, RUNS if masked else None)

    def work(parallel: SequenceParallel, rank: int) -> list[Tensor]:
        attend = parallel.self_attention(kernel)
        q_, k_, v_ = (parallel.split(t, 2).clone().requires_grad_() for t in (q, k, v))
        out = attend(q_, k_, v_)
        (out * parallel.split(grad_out, 2)).sum().backward()
        return [out.detach(), q_.grad, k_.grad, v_.grad]

    results = on_threads(size, work, mode="ring")
    for got, expected in zip(zip(*results, strict=True), want, strict=True):
        torch.testing.assert_close(torch.cat(got, 2), expected, rtol=1e-5, atol=1e-6)


def test_ring_mode_keeps_the_all_to_all_for_other_kernels():
    """A kernel without groups (an ST-DiT's spatial or temporal one) is not ringed: ring mode
    hands it the whole sequence for a share of the heads, as Ulysses does."""
    seen = []

    def spatial(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        seen.append(q.shape)
        return q

    def work(parallel: SequenceParallel, rank: int) -> Tensor:
        return parallel.self_attention(spatial)(*[torch.zeros(1, 4, 3, 2)] * 3)

    on_threads(2, work, mode="ring")
    assert seen == [torch.Size([1, 2, 6, 2])] * 2
