"""Attention of the DiT over one sample per row, or over packs of samples.

A batch of same-shaped samples attends with plain ``scaled_dot_product_attention``. A pack
(:class:`~impasto.models.dit.layout.Pack`) must keep every sample to itself: its self-attention
is block-diagonal over the samples and its cross-attention lets each sample see its own text
tokens only. Three kernels do that and agree (tests/test_dit.py):

- ``flex``: FlexAttention with a document ``BlockMask`` (torchtitan's and NeMo's choice on the
  GPU; its backward needs CUDA);
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (Flash Attention over cumulative
  sequence lengths; CUDA, bf16/fp16);
- ``grouped``: ``scaled_dot_product_attention`` over each run of same-length samples as a
  batch of its own (a pack holds its shape groups one after another): no mask, no work across
  samples; the CPU's kernel;
- ``sdpa``: ``scaled_dot_product_attention`` with a boolean mask over the whole pack (any
  device; memory and work S²).

Padding tokens form a document of their own in self-attention and see all text tokens in
cross-attention (so no row is empty); their outputs are discarded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from impasto.models.dit.layout import Pack

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]
"""``(q [B, H, Sq, Dh], k [B, H, Sk, Dh], v) -> [B, H, Sq, Dh]``."""


def dense(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """Every query sees every key (a batch of same-shaped samples)."""
    return F.scaled_dot_product_attention(query, key, value)


class PackAttention:
    """The self- and cross-attention of one pack with ``text_length`` text tokens per sample,
    on kernel ``backend`` (see the module docstring)."""

    def __init__(self, pack: Pack, text_length: int, backend: str) -> None:
        if backend not in PACK_KERNELS:
            raise ValueError(f"model.dit.attention: unknown kernel {backend!r}; valid: "
                             f"{', '.join(sorted(PACK_KERNELS))}")  # fmt: skip
        self.pack = pack
        self.backend = backend
        device = pack.document.device
        samples = torch.arange(pack.num_samples, device=device)
        self.text_document = samples.repeat_interleave(text_length)  # [N·L]
        self.text_length = text_length
        self._self, self._cross = PACK_KERNELS[backend](self)

    def self_attention(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        return self._self(query, key, value)

    def cross_attention(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        return self._cross(query, key, value)

    # -- masks ----------------------------------------------------------------------------
    def self_allowed(self) -> Tensor:
        """``[S, S]`` bool: query token i may see key token j."""
        document = self.pack.document
        return document[:, None] == document[None, :]

    def cross_allowed(self) -> Tensor:
        """``[S, N·L]`` bool: query token i may see text token j."""
        document = self.pack.document
        padding = (document == self.pack.num_samples)[:, None]
        return (document[:, None] == self.text_document[None, :]) | padding


def _sdpa(attention: PackAttention) -> tuple[Attend, Attend]:
    self_mask, cross_mask = attention.self_allowed(), attention.cross_allowed()

    def self_attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self_mask)

    def cross_attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=cross_mask)

    return self_attend, cross_attend


def _flex(attention: PackAttention) -> tuple[Attend, Attend]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    document, text_document = attention.pack.document, attention.text_document
    padding = attention.pack.num_samples
    size, text_size = document.shape[0], text_document.shape[0]

    def same_sample(batch, head, q_index, kv_index):  # noqa: ANN001  (FlexAttention's signature)
        return document[q_index] == document[kv_index]

    def own_text(batch, head, q_index, kv_index):  # noqa: ANN001
        q_document = document[q_index]
        return (q_document == text_document[kv_index]) | (q_document == padding)

    device = document.device
    if device.type == "cuda":  # eager FlexAttention materialises the scores; compiled, it fuses
        flex_attention = _compiled_flex()
    self_mask = create_block_mask(same_sample, None, None, size, size, device=device)
    cross_mask = create_block_mask(own_text, None, None, size, text_size, device=device)

    def self_attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return flex_attention(q, k, v, block_mask=self_mask)

    def cross_attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return flex_attention(q, k, v, block_mask=cross_mask)

    return self_attend, cross_attend


@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _cumulative(lengths: list[int], device: torch.device) -> Tensor:
    return torch.tensor([0, *lengths], device=device, dtype=torch.int32).cumsum(
        0, dtype=torch.int32
    )


def _varlen(attention: PackAttention) -> tuple[Attend, Attend]:
    from torch.nn.attention.varlen import varlen_attn

    pack = attention.pack
    device = pack.document.device
    lengths, used = pack.lengths, pack.num_tokens
    text_lengths = [attention.text_length] * pack.num_samples
    cu_q, cu_text = _cumulative(lengths, device), _cumulative(text_lengths, device)
    max_q = max(lengths)

    def run(q: Tensor, k: Tensor, v: Tensor, cu_k: Tensor, max_k: int, keys: int) -> Tensor:
        # [1, H, S, Dh] → the kernel's [T, H, Dh] over the real tokens; padding rows stay zero.
        q_rows = q[0, :, :used].transpose(0, 1)
        k_rows, v_rows = (t[0, :, :keys].transpose(0, 1) for t in (k, v))
        out = varlen_attn(q_rows, k_rows, v_rows, cu_q, cu_k, max_q, max_k)
        full = q.new_zeros(q.shape[2], q.shape[1], q.shape[3])
        full[:used] = out
        return full.transpose(0, 1)[None]

    def self_attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return run(q, k, v, cu_q, max_q, used)

    def cross_attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return run(q, k, v, cu_text, attention.text_length, k.shape[2])

    return self_attend, cross_attend


def _runs(pack: Pack, text_length: int) -> list[tuple[int, int, int, int]]:
    """(first token, first text token, samples, tokens per sample) of each run of consecutive
    samples with as many tokens (a pack lays its shape groups out one after another)."""
    runs: list[tuple[int, int, int, int]] = []
    token = 0
    for index, length in enumerate(pack.lengths):
        if runs and runs[-1][3] == length:
            first, first_text, count, _ = runs[-1]
            runs[-1] = (first, first_text, count + 1, length)
        else:
            runs.append((token, index * text_length, 1, length))
        token += length
    return runs


def _grouped(attention: PackAttention) -> tuple[Attend, Attend]:
    runs = _runs(attention.pack, attention.text_length)
    text_length = attention.text_length

    def attend(q: Tensor, k: Tensor, v: Tensor, cross: bool) -> Tensor:
        out = torch.zeros_like(q)  # padding rows stay zero (discarded)
        for first, first_text, count, length in runs:
            rows = slice(first, first + count * length)
            keys = slice(first_text, first_text + count * text_length) if cross else rows
            key_length = text_length if cross else length
            # [1, H, n·L, Dh] → [n, H, L, Dh]: the run's samples as a batch of their own
            query = q[0, :, rows].unflatten(1, (count, length)).transpose(0, 1)
            key, value = (
                t[0, :, keys].unflatten(1, (count, key_length)).transpose(0, 1) for t in (k, v)
            )
            attended = F.scaled_dot_product_attention(query, key, value)
            out[0, :, rows] = attended.transpose(0, 1).flatten(1, 2)
        return out

    return (lambda q, k, v: attend(q, k, v, False)), (lambda q, k, v: attend(q, k, v, True))


PACK_KERNELS: dict[str, Callable[[PackAttention], tuple[Attend, Attend]]] = {
    "grouped": _grouped,
    "sdpa": _sdpa,
    "flex": _flex,
    "varlen": _varlen,
}
"""``model.dit.attention`` → the builder of a pack's (self, cross) attention."""


def pick_kernel(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` resolved for a device and compute dtype (see ``model.dit.attention``)."""
    if backend != "auto":
        return backend
    if device.type != "cuda":
        return "grouped"
    return "varlen" if dtype in (torch.bfloat16, torch.float16) else "flex"
