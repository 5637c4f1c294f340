"""The DiT's layers: embeddings of time, text and positions, attention and MLPs, and the
adaLN modulation helpers. Plain PyTorch; every projection is its own ``nn.Linear`` so that
tensor parallelism can split it (column-wise in, row-wise out)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from impasto.models.dit.attention import Attend

FREQUENCY_DIM = 256  # sinusoidal features of the time, before its MLP (DiT)
ROPE_THETA = 10_000.0
NORM_EPS = 1e-6


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN: ``x · (1 + scale) + shift`` (DiT's ``modulate``)."""
    return x * (1 + scale) + shift


def timestep_features(timesteps: Tensor, dim: int = FREQUENCY_DIM) -> Tensor:
    """``[B]`` → ``[B, dim]``: ``[cos(t·f), sin(t·f)]`` with frequencies ``f`` from 1 down to
    1/10000 (DiT's ``TimestepEmbedder.timestep_embedding``); float32."""
    half = dim // 2
    frequencies = torch.exp(
        -math.log(10_000) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half
    )
    angles = timesteps.float()[:, None] * frequencies[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class MLPEmbedder(nn.Module):
    """``linear_2(act(linear_1(x)))``: the time, pooled-text and text-token embedders."""

    def __init__(self, in_dim: int, dim: int, activation: nn.Module) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.act = activation
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def head_norm(kind: str, head_dim: int) -> nn.Module:
    """QK normalisation over each head's features: RMSNorm, LayerNorm or none."""
    if kind == "rms":
        return nn.RMSNorm(head_dim, eps=NORM_EPS)
    if kind == "layer":
        return nn.LayerNorm(head_dim, eps=NORM_EPS)
    return nn.Identity()


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Features of each head given to the (frame, row, column) axes: ``d − 4⌊d/6⌋``,
    ``2⌊d/6⌋``, ``2⌊d/6⌋`` (Wan 2.1's split; each even)."""
    sixth = head_dim // 6
    return head_dim - 4 * sixth, 2 * sixth, 2 * sixth


def rope_angles(positions: Tensor, head_dim: int, theta: float = ROPE_THETA) -> Tensor:
    """``[..., 3]`` int positions → ``[..., head_dim / 2]`` float32 angles: each axis ``a`` of
    dims ``d_a`` (:func:`rope_axis_dims`) turns at ``position_a · θ^(−2i/d_a)``."""
    angles = []
    for axis, dims in enumerate(rope_axis_dims(head_dim)):
        if dims == 0:
            continue
        exponent = torch.arange(0, dims, 2, dtype=torch.float32, device=positions.device) / dims
        angles.append(positions[..., axis, None].float() * theta**-exponent)
    return torch.cat(angles, dim=-1)


def rope_rotation(positions: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
    """(cos, sin) ``[B or 1, S, 1, Dh/2]`` of :func:`rope_angles`, computed once per forward
    and shared by every block's queries and keys."""
    angles = rope_angles(positions, head_dim)
    return angles.cos()[:, :, None], angles.sin()[:, :, None]


def apply_rope(x: Tensor, rotation: tuple[Tensor, Tensor]) -> Tensor:
    """Rotate ``x`` ``[B, S, H, Dh]`` by ``rotation`` (:func:`rope_rotation`) in the
    rotate-half (GPT-NeoX) convention: feature i pairs with i + Dh/2; float32 math, ``x``'s
    dtype out."""
    cos, sin = rotation
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return rotated.to(x.dtype)


def sincos_embedding(positions: Tensor, dim: int) -> Tensor:
    """``[..., 3]`` positions → ``[..., dim]`` fixed 2-D sine-cosine embedding of (row, column):
    half the features each, ``[sin, cos]`` per axis (MAE / DiT ``get_2d_sincos_pos_embed``)."""
    quarter = dim // 4
    omega = 1.0 / 10_000 ** (
        torch.arange(quarter, dtype=torch.float32, device=positions.device) / quarter
    )
    parts = []
    for axis in (1, 2):
        angles = positions[..., axis, None].float() * omega
        parts += [torch.sin(angles), torch.cos(angles)]
    return torch.cat(parts, dim=-1)


class Attention(nn.Module):
    """Multi-head attention with separate q, k, v, out projections and per-head QK norm.
    ``rope`` (cos, sin) rotates queries and keys of self-attention; cross-attention has none."""

    def __init__(
        self, dim: int, head_dim: int, qk_norm: str, bias: bool, context_dim: int | None = None
    ) -> None:
        super().__init__()
        context_dim = context_dim or dim
        self.head_dim = head_dim
        self.to_q = nn.Linear(dim, dim, bias=bias)
        self.to_k = nn.Linear(context_dim, dim, bias=bias)
        self.to_v = nn.Linear(context_dim, dim, bias=bias)
        self.to_out = nn.Linear(dim, dim, bias=bias)
        self.norm_q = head_norm(qk_norm, head_dim)
        self.norm_k = head_norm(qk_norm, head_dim)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (-1, self.head_dim))  # [B, S, H, Dh]; H local under TP

    def forward(
        self,
        x: Tensor,
        attend: Attend,
        context: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        context = x if context is None else context
        query = self.norm_q(self._heads(self.to_q(x)))
        key = self.norm_k(self._heads(self.to_k(context)))
        value = self._heads(self.to_v(context))
        if rope is not None:
            query, key = apply_rope(query, rope), apply_rope(key, rope)
        out = attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
        return self.to_out(out.transpose(1, 2).flatten(2))


class GeluMLP(nn.Module):
    """``fc2(gelu_tanh(fc1(x)))`` with 4× width (DiT)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def swiglu_width(dim: int) -> int:
    """Llama's hidden width: ⌈(8/3)·dim / 64⌉·64, the same parameters as a 4× GELU MLP."""
    return -(-8 * dim // 3 // 64) * 64


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) · up(x))`` without biases (Llama, MovieGen)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        hidden = swiglu_width(dim)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))
