"""Attention of the DiT over one sample per row, or over packs of samples.

Self-attention has three layouts (``model.dit.attention`` picks which blocks use which,
:mod:`impasto.models.dit.network`): ``full`` (every token of a sample), ``spatial`` (the tokens
of one frame of a sample) and ``temporal`` (the tokens of one patch position of a sample,
across its frames).

A batch of same-shaped samples attends with plain ``scaled_dot_product_attention``: spatial
attention runs the frames as a batch ``[B·F, rows·cols]``, temporal attention the patch
positions ``[B·rows·cols, F]`` (:func:`dense_attends`).

A pack (:class:`~impasto.models.dit.layout.Pack`) must keep every group of a layout to itself
(:class:`~impasto.models.dit.layout.Partition`): its self-attention is block-diagonal over
the groups and its cross-attention lets each sample see its own text tokens only. A layout
whose groups are not contiguous in the pack (temporal: a patch position's tokens sit
``rows·cols`` apart) runs on the tokens rearranged group after group and back
(:func:`_rearranged`), so every kernel sees contiguous groups. Four kernels do that and agree
(tests/test_dit.py, tests/test_dit_video.py):

- ``flex``: FlexAttention with a ``BlockMask`` from the group ids (torchtitan's and NeMo's
  choice on the GPU; its backward needs CUDA);
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (Flash Attention over cumulative
  sequence lengths of the groups; CUDA, bf16/fp16; not testable on the CPU);
- ``grouped``: ``scaled_dot_product_attention`` over each run of same-length groups as a
  batch of its own (a pack holds its shape groups one after another): no mask, no work across
  groups; the CPU's kernel;
- ``sdpa``: ``scaled_dot_product_attention`` with a boolean mask from the group ids over the
  whole pack (any device; memory and work S²).

Padding tokens form a group of their own in self-attention and see all text tokens in
cross-attention (so no row is empty); their outputs are discarded.

Full self-attention (dense, or a pack's document mask) is a
:class:`~impasto.models.ring_attention.BlockDiagonal`: called, it is the kernel; it also tells
ring-mode context parallelism (``parallel.cp_mode: ring``) the groups to mask its blocks with.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from impasto.models.dit.layout import Pack, Partition, partition
from impasto.models.ring_attention import BlockDiagonal

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]
"""``(q [B, H, Sq, Dh], k [B, H, Sk, Dh], v) -> [B, H, Sq, Dh]``."""

Run = tuple[int, int, int, int, int]
"""(first query, first key, batch, queries per batch row, keys per batch row)."""


def dense(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """Every query sees every key (a batch of same-shaped samples)."""
    return F.scaled_dot_product_attention(query, key, value)


def dense_attends(frames: int, cells: int) -> dict[str, Attend]:
    """The self-attention layouts of a batch of same-shaped samples of ``frames`` × ``cells``
    tokens (frame-major): full, spatial (each frame alone) and temporal (each patch position
    alone)."""

    def spatial(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        def split(t: Tensor) -> Tensor:  # [B, H, F·P, Dh] → [B·F, H, P, Dh]
            return t.unflatten(2, (frames, cells)).transpose(1, 2).flatten(0, 1)

        out = F.scaled_dot_product_attention(split(q), split(k), split(v))
        return out.unflatten(0, (-1, frames)).transpose(1, 2).flatten(2, 3)

    def temporal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        def split(t: Tensor) -> Tensor:  # [B, H, F·P, Dh] → [B·P, H, F, Dh]
            return t.unflatten(2, (frames, cells)).permute(0, 3, 1, 2, 4).flatten(0, 1)

        out = F.scaled_dot_product_attention(split(q), split(k), split(v))
        return out.unflatten(0, (-1, cells)).permute(0, 2, 3, 1, 4).flatten(2, 3)

    return {"full": BlockDiagonal(dense), "spatial": spatial, "temporal": temporal}


class PackAttention:
    """The self-attention layouts ``layouts`` and the cross-attention of one pack with
    ``text_length`` text tokens per sample, on kernel ``backend`` (see the module
    docstring)."""

    def __init__(
        self, pack: Pack, text_length: int, backend: str, layouts: Sequence[str] = ("full",)
    ) -> None:
        if backend not in PACK_KERNELS:
            raise ValueError(f"model.dit.kernel: unknown kernel {backend!r}; valid: "
                             f"{', '.join(sorted(PACK_KERNELS))}")  # fmt: skip
        self.pack = pack
        self.backend = backend
        device = pack.document.device
        samples = torch.arange(pack.num_samples, device=device)
        self.text_document = samples.repeat_interleave(text_length)  # [N·L]
        self.text_length = text_length
        self_kernel, cross_kernel = PACK_KERNELS[backend]
        self.partitions = {layout: partition(pack, layout) for layout in layouts}
        self.attends: dict[str, Attend] = {
            layout: _rearranged(self_kernel(self, groups), groups)
            for layout, groups in self.partitions.items()
        }
        self._cross = cross_kernel(self)
        if "full" in self.attends:  # the document mask, for ring attention over shards
            full = self.partitions["full"]
            runs = (*full.lengths, pack.capacity - pack.num_tokens)  # the padding last
            self.attends["full"] = BlockDiagonal(self.attends["full"], full.ids, runs)

    def self_attention(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Full self-attention: each sample to itself."""
        return self.attends["full"](query, key, value)

    def cross_attention(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        return self._cross(query, key, value)

    # -- masks ----------------------------------------------------------------------------
    def self_allowed(self, layout: str = "full") -> Tensor:
        """``[S, S]`` bool, pack order: query token i may see key token j under ``layout``."""
        ids = self.partitions[layout].ids
        return ids[:, None] == ids[None, :]

    def cross_allowed(self) -> Tensor:
        """``[S, N·L]`` bool: query token i may see text token j."""
        document = self.pack.document
        padding = (document == self.pack.num_samples)[:, None]
        return (document[:, None] == self.text_document[None, :]) | padding


def _rearranged(attend: Attend, groups: Partition) -> Attend:
    """``attend`` (which needs contiguous groups) run on the tokens in ``groups.order``, its
    output put back in pack order; ``attend`` itself where the groups are contiguous."""
    order, inverse = groups.order, groups.inverse
    if order is None:
        return attend

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = attend(q[:, :, order], k[:, :, order], v[:, :, order])
        return out[:, :, inverse]

    return run


# -- sdpa -------------------------------------------------------------------------------------
def _sdpa_self(attention: PackAttention, groups: Partition) -> Attend:
    ids = groups.contiguous_ids
    mask = ids[:, None] == ids[None, :]
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _sdpa_cross(attention: PackAttention) -> Attend:
    mask = attention.cross_allowed()
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# -- flex -------------------------------------------------------------------------------------
def _flex_attention(device: torch.device) -> Callable[..., Tensor]:
    """FlexAttention, compiled on CUDA (eager, it materialises the scores; compiled, it fuses)."""
    from torch.nn.attention.flex_attention import flex_attention

    return _compiled_flex() if device.type == "cuda" else flex_attention


def _flex_self(attention: PackAttention, groups: Partition) -> Attend:
    from torch.nn.attention.flex_attention import create_block_mask

    ids = groups.contiguous_ids
    size, device = ids.shape[0], ids.device

    def same_group(batch, head, q_index, kv_index):  # noqa: ANN001  (FlexAttention's signature)
        return ids[q_index] == ids[kv_index]

    flex_attention = _flex_attention(device)
    mask = create_block_mask(same_group, None, None, size, size, device=device)
    return lambda q, k, v: flex_attention(q, k, v, block_mask=mask)


def _flex_cross(attention: PackAttention) -> Attend:
    from torch.nn.attention.flex_attention import create_block_mask

    document, text_document = attention.pack.document, attention.text_document
    padding, device = attention.pack.num_samples, document.device

    def own_text(batch, head, q_index, kv_index):  # noqa: ANN001
        q_document = document[q_index]
        return (q_document == text_document[kv_index]) | (q_document == padding)

    flex_attention = _flex_attention(device)
    size, text_size = document.shape[0], text_document.shape[0]
    mask = create_block_mask(own_text, None, None, size, text_size, device=device)
    return lambda q, k, v: flex_attention(q, k, v, block_mask=mask)


@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


# -- varlen -----------------------------------------------------------------------------------
def _cumulative(lengths: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor([0, *lengths], device=device, dtype=torch.int32).cumsum(
        0, dtype=torch.int32
    )


def _varlen_run(
    used: int, cu_q: Tensor, max_q: int, cu_k: Tensor, max_k: int, keys: int | None
) -> Attend:
    """``varlen_attn`` over the first ``used`` queries and the first ``keys`` keys (None: all
    of them); padding rows stay zero."""
    from torch.nn.attention.varlen import varlen_attn

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # [1, H, S, Dh] → the kernel's [T, H, Dh] over the real tokens
        q_rows = q[0, :, :used].transpose(0, 1)
        k_rows, v_rows = (t[0, :, :keys].transpose(0, 1) for t in (k, v))
        out = varlen_attn(q_rows, k_rows, v_rows, cu_q, cu_k, max_q, max_k)
        full = q.new_zeros(q.shape[2], q.shape[1], q.shape[3])
        full[:used] = out
        return full.transpose(0, 1)[None]

    return run


def _varlen_self(attention: PackAttention, groups: Partition) -> Attend:
    pack, lengths = attention.pack, groups.lengths
    used, cu = pack.num_tokens, _cumulative(lengths, pack.document.device)
    return _varlen_run(used, cu, max(lengths), cu, max(lengths), used)


def _varlen_cross(attention: PackAttention) -> Attend:
    pack, text_length = attention.pack, attention.text_length
    device = pack.document.device
    cu_q = _cumulative(pack.lengths, device)
    cu_text = _cumulative([text_length] * pack.num_samples, device)
    return _varlen_run(pack.num_tokens, cu_q, max(pack.lengths), cu_text, text_length, None)


# -- grouped ----------------------------------------------------------------------------------
def _equal_runs(lengths: Sequence[int], key_length: int | None = None) -> list[Run]:
    """The :data:`Run` of each stretch of consecutive groups with as many tokens: their keys
    are the queries themselves (``key_length`` None), or ``key_length`` text tokens per group
    (group i's from ``i · key_length``)."""
    runs: list[Run] = []
    token = 0
    for index, length in enumerate(lengths):
        if runs and runs[-1][3] == length:
            first, first_key, count, _, keys = runs[-1]
            runs[-1] = (first, first_key, count + 1, length, keys)
        elif key_length is None:
            runs.append((token, token, 1, length, length))
        else:
            runs.append((token, index * key_length, 1, length, key_length))
        token += length
    return runs


def _grouped_run(runs: list[Run]) -> Attend:
    """SDPA over each run as a batch of its own; rows outside every run (padding) stay zero."""

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = torch.zeros_like(q)
        for first, first_key, count, length, key_length in runs:
            rows = slice(first, first + count * length)
            keys = slice(first_key, first_key + count * key_length)
            # [1, H, n·L, Dh] → [n, H, L, Dh]: the run's groups as a batch of their own
            query = q[0, :, rows].unflatten(1, (count, length)).transpose(0, 1)
            key, value = (
                t[0, :, keys].unflatten(1, (count, key_length)).transpose(0, 1) for t in (k, v)
            )
            attended = F.scaled_dot_product_attention(query, key, value)
            out[0, :, rows] = attended.transpose(0, 1).flatten(1, 2)
        return out

    return attend


def _grouped_self(attention: PackAttention, groups: Partition) -> Attend:
    return _grouped_run(_equal_runs(groups.lengths))


def _grouped_cross(attention: PackAttention) -> Attend:
    return _grouped_run(_equal_runs(attention.pack.lengths, attention.text_length))


PACK_KERNELS: dict[str, tuple[Callable[[PackAttention, Partition], Attend],
                              Callable[[PackAttention], Attend]]] = {
    "grouped": (_grouped_self, _grouped_cross),
    "sdpa": (_sdpa_self, _sdpa_cross),
    "flex": (_flex_self, _flex_cross),
    "varlen": (_varlen_self, _varlen_cross),
}  # fmt: skip
"""``model.dit.kernel`` → the builders of a pack's self-attention over one partition, and of
its cross-attention."""


def pick_kernel(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` resolved for a device and compute dtype (see ``model.dit.kernel``)."""
    if backend != "auto":
        return backend
    if device.type != "cuda":
        return "grouped"
    return "varlen" if dtype in (torch.bfloat16, torch.float16) else "flex"
