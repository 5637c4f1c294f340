"""The diffusion transformer: patches of latents in, the objective's prediction out.

Three block variants (``model.dit.block``), all zero-initialised so that a new network predicts
zero and every block starts as the identity (adaLN-Zero, Peebles & Xie 2023, §3.2):

- ``adaln``: ``x += g₁·attn(mod(norm(x)))``, ``x += g₂·mlp(mod(norm(x)))``; shift, scale and
  gate from the time and the pooled text (the DiT paper's best block);
- ``cross``: ``adaln`` plus a modulated cross-attention to the text tokens between the two
  (NeMo's ``DiTCrossAttention`` block; 9 modulation vectors);
- ``llama``: RMSNorm, SwiGLU and bias-free projections, modulated self-attention and MLP, and a
  plain pre-norm cross-attention whose output projection starts at zero (MovieGen, Polyak et
  al. 2024, §3.1).

Latents are images ``[B, C, h, w]`` or clips ``[B, C, F, h, w]`` (:mod:`.layout`). Which
tokens a block's self-attention reads is ``model.dit.attention`` (:data:`BLOCK_ATTENTION`):

- ``full``: every token of its sample;
- ``spatiotemporal`` (ST-DiT: OpenSora's STDiT, Latte's variant 3): each block attends within
  each frame (``attn``), then within each patch position across the frames
  (``attn_temporal``, with a norm of its own), then to the text, then the MLP. The temporal
  branch is adaLN-Zero like the others: the block's modulation has a shift, scale and gate
  more for it (its last three vectors), zero at the start, so the branch starts as the
  identity and a new network still predicts zero;
- ``alternating`` (Latte's variant 1, interleaved blocks): even blocks attend within each frame,
  odd blocks within each patch position; the blocks are those of ``full``.

The same 3-D RoPE serves all three: within a frame the frame angles cancel in ``q·k``, within
a patch position the row and column angles do.

The same weights run a batch of same-shaped samples (:meth:`DiT.forward`) or a pack of
samples of different shapes in one sequence (:meth:`DiT.forward_packed`), where every sample
keeps its own time, text and positions; both give the same prediction per sample.
Parameter names are the safetensors layout (docs/dit.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from impasto.models.dit.attention import Attend, PackAttention, dense_attends, pick_kernel
from impasto.models.dit.layers import (
    FREQUENCY_DIM,
    NORM_EPS,
    Attention,
    GeluMLP,
    MLPEmbedder,
    SwiGLU,
    modulate,
    rope_rotation,
    sincos_embedding,
    swiglu_width,
    timestep_features,
)
from impasto.models.dit.layout import Grid, grid_positions, patchify, plan_pack, unpatchify
from impasto.models.dit.sizes import SIZES
from impasto.models.sequence_parallel import SequenceParallel


@dataclass(frozen=True)
class DiTConfig:
    """Everything that fixes the network's shape (saved beside exported weights as JSON)."""

    size: str = "tiny"
    block: str = "cross"
    patch_size: int = 2
    in_channels: int = 4
    text_dim: int = 64  # features of a text token
    pooled_dim: int = 32  # features of the pooled text
    qk_norm: str = "rms"
    position: str = "rope"
    max_grid: int = 64
    text_tokens: int | None = None  # read the first N text tokens only (None: all)
    frame_patch: int = 1  # latent frames per token
    attention: str = "full"  # which tokens self-attention reads (BLOCK_ATTENTION)

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"unknown DiT size {self.size!r}; valid: {', '.join(SIZES)}")
        if self.attention not in BLOCK_ATTENTION:
            raise ValueError(f"unknown DiT attention {self.attention!r}; valid: "
                             f"{', '.join(BLOCK_ATTENTION)}")  # fmt: skip
        if self.frame_patch < 1:
            raise ValueError(f"frame_patch must be at least 1, got {self.frame_patch}")

    @property
    def hidden_size(self) -> int:
        return SIZES[self.size].hidden_size

    @property
    def num_layers(self) -> int:
        return SIZES[self.size].num_layers

    @property
    def head_dim(self) -> int:
        return SIZES[self.size].head_dim

    @property
    def has_text_tokens(self) -> bool:
        return self.block != "adaln"

    @property
    def patch_values(self) -> int:
        """Latent values per token: ``C·pt·p·p``."""
        return self.in_channels * self.frame_patch * self.patch_size**2

    def block_attention(self, index: int) -> tuple[str, str | None]:
        """Block ``index``'s self-attention layout, and its temporal attention's (or None)."""
        return BLOCK_ATTENTION[self.attention](index)

    @property
    def layouts(self) -> tuple[str, ...]:
        """Every self-attention layout some block reads."""
        used = {layout for index in range(self.num_layers)
                for layout in self.block_attention(index) if layout is not None}  # fmt: skip
        return tuple(sorted(used))

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


BLOCK_ATTENTION: dict[str, Callable[[int], tuple[str, str | None]]] = {
    "full": lambda index: ("full", None),
    "spatiotemporal": lambda index: ("spatial", "temporal"),
    "alternating": lambda index: ("temporal" if index % 2 else "spatial", None),
}
"""``model.dit.attention`` → block index → (its self-attention's layout, its temporal
attention's layout or None): see the module docstring."""


def per_token(vectors: Tensor, document: Tensor | None) -> Tensor:
    """Each token's row of ``vectors`` ``[N, ·]`` (a pack: ``document`` ``[S]`` says whose;
    ``[1, S, ·]``), or each sample's broadcast over its tokens (``[B, 1, ·]``).
    ``index_select``, not ``vectors[document]``: indexing's backward accumulates with atomic
    adds on a multi-threaded CPU, in an order that changes from run to run."""
    if document is None:
        return vectors[:, None]
    return vectors.index_select(0, document)[None]


def _norm(config: DiTConfig, affine: bool = False) -> nn.Module:
    dim = config.hidden_size
    if config.block == "llama":
        return nn.RMSNorm(dim, eps=NORM_EPS, elementwise_affine=affine)
    return nn.LayerNorm(dim, eps=NORM_EPS, elementwise_affine=affine)


MODULATIONS = {"adaln": 6, "cross": 9, "llama": 6}  # vectors of D per block
TEMPORAL_MODULATIONS = 3  # shift, scale, gate of a spatiotemporal block's temporal attention


class Block(nn.Module):
    """One transformer block (see the module docstring for the variants)."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        dim, head_dim, bias = config.hidden_size, config.head_dim, config.block != "llama"
        self.variant = config.block
        self.gradient_checkpointing = False  # recompute in backward (memory.gradient_checkpointing)
        self.norm1 = _norm(config)
        self.attn = Attention(dim, head_dim, config.qk_norm, bias)
        self.temporal = config.attention == "spatiotemporal"
        if self.temporal:
            self.norm_temporal = _norm(config)
            self.attn_temporal = Attention(dim, head_dim, config.qk_norm, bias)
        if config.has_text_tokens:
            self.norm_cross = _norm(config, affine=config.block == "llama")
            self.cross = Attention(dim, head_dim, config.qk_norm, bias)
        self.norm2 = _norm(config)
        self.mlp = SwiGLU(dim) if config.block == "llama" else GeluMLP(dim)
        self.mlp_width = swiglu_width(dim) if config.block == "llama" else 4 * dim
        self.num_modulations = MODULATIONS[config.block] + self.temporal * TEMPORAL_MODULATIONS
        self.modulation = nn.Linear(dim, self.num_modulations * dim)

    def forward(
        self, x: Tensor, modulation_input: Tensor, rope: tuple[Tensor, Tensor] | None,
        text: Tensor | None, attend_self: Attend, attend_cross: Attend,
        document: Tensor | None = None, attend_temporal: Attend | None = None,
    ) -> Tensor:  # fmt: skip
        """``x`` ``[B, S, D]``; ``modulation_input`` ``[N, D]`` (one row per sample: B rows,
        or a pack's N samples gathered per token through ``document`` ``[S]``);
        ``attend_temporal``: the temporal attention of a spatiotemporal block."""
        vectors = self.modulation(modulation_input)
        vectors = per_token(vectors, document)
        chunks = vectors.chunk(self.num_modulations, dim=-1)
        shift1, scale1, gate1, shift2, scale2, gate2 = chunks[:6]
        x = x + gate1 * self.attn(modulate(self.norm1(x), shift1, scale1), attend_self, rope=rope)
        if self.temporal:
            assert attend_temporal is not None, "a spatiotemporal block needs attend_temporal"
            shift_t, scale_t, gate_t = chunks[-TEMPORAL_MODULATIONS:]
            normed = modulate(self.norm_temporal(x), shift_t, scale_t)
            x = x + gate_t * self.attn_temporal(normed, attend_temporal, rope=rope)
        if self.variant == "cross":
            shift_c, scale_c, gate_c = chunks[6:9]
            crossed = self.cross(
                modulate(self.norm_cross(x), shift_c, scale_c), attend_cross, context=text
            )
            x = x + gate_c * crossed
        elif self.variant == "llama":
            x = x + self.cross(self.norm_cross(x), attend_cross, context=text)
        return x + gate2 * self.mlp(modulate(self.norm2(x), shift2, scale2))


class FinalLayer(nn.Module):
    """Modulated norm, then a linear map of each token to its patch's ``C·pt·p·p`` values."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.norm = _norm(config)
        self.modulation = nn.Linear(dim, 2 * dim)
        self.linear = nn.Linear(dim, config.patch_values)

    def forward(self, x: Tensor, modulation_input: Tensor, document: Tensor | None) -> Tensor:
        vectors = self.modulation(modulation_input)
        vectors = per_token(vectors, document)
        shift, scale = vectors.chunk(2, dim=-1)
        return self.linear(modulate(self.norm(x), shift, scale))


@dataclass(frozen=True)
class TrunkCall:
    """One call of the network, prepared from its inputs (:meth:`TokenCalls.prepare`): what
    the blocks read, and how the final layer's output becomes the prediction. A pipeline stage
    (:mod:`.pipeline`) runs a part of the blocks on it; every stage prepares it alike."""

    tokens: Tensor  # [B, S, C·pt·p·p] patches (a pack: B = 1, S its capacity)
    positions: Tensor  # [1, S, 3] (frame, row, column) of each token
    timesteps: Tensor  # [N]: one per sample
    text: Tensor | None  # [N or 1, L or N·L, text_dim] tokens read (a pack's flattened)
    pooled: Tensor  # [N, pooled_dim]
    attends: Mapping[str, Attend]  # each self-attention layout's kernel (BLOCK_ATTENTION)
    attend_cross: Attend
    document: Tensor | None  # [S] each token's sample (a pack), None for a dense batch
    finish: Callable[[Tensor], Tensor | list[Tensor]]  # [B, S, C·pt·p·p] → the prediction
    dtype: torch.dtype  # of the hidden states between the blocks


def embed_tokens(
    network: nn.Module, tokens: Tensor, positions: Tensor
) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """The patch embedding plus the position embedding (sincos, learned), or with RoPE's
    (cos, sin) beside it."""
    config = network.config
    tokens = network.patch_embed(tokens)
    if config.position == "rope":
        return tokens, rope_rotation(positions, config.head_dim)
    if config.position == "sincos":
        return tokens + sincos_embedding(positions, config.hidden_size).to(tokens.dtype), None
    rows, cols = positions[..., 1], positions[..., 2]
    if int(rows.max()) >= config.max_grid or int(cols.max()) >= config.max_grid:
        raise ValueError(
            f"model.dit.max_grid: the learned position table covers {config.max_grid} "
            "patches per side, this input has more; raise it or use position: rope"
        )
    return tokens + network.pos_embed[rows, cols].to(tokens.dtype), None


def conditioning(
    network: nn.Module, call: TrunkCall, dtype: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    """(the modulation input ``[N (+1 for a pack's padding), D]`` from the time and pooled
    text, the embedded text tokens or None)."""
    condition = network.time_embed(timestep_features(call.timesteps).to(dtype))
    condition = nn.functional.silu(condition + network.pooled_embed(call.pooled.to(dtype)))
    if call.document is not None:  # a pack's padding tokens read a zero condition
        condition = torch.cat([condition, condition.new_zeros(1, condition.shape[1])])
    context = None
    if network.config.has_text_tokens and call.text is not None:
        context = network.text_embed(call.text.to(dtype))
    return condition, context


def named_blocks(blocks: nn.Module) -> list[tuple[int, nn.Module]]:
    """(index in the whole network, block) of a block list or a stage's dict of them."""
    return [(int(name), block) for name, block in blocks.named_children()]


def run_blocks(
    config: DiTConfig, blocks: list[tuple[int, nn.Module]], x: Tensor, condition: Tensor,
    rope: tuple[Tensor, Tensor] | None, context: Tensor | None, call: TrunkCall,
) -> Tensor:  # fmt: skip
    """``x`` ``[B, S, D]`` through ``blocks`` (each with its index's attention layout)."""
    for index, block in blocks:
        layout, temporal = config.block_attention(index)
        inputs = (x, condition, rope, context, call.attends[layout], call.attend_cross)
        options = {"document": call.document, "attend_temporal": call.attends.get(temporal)}
        if block.gradient_checkpointing and torch.is_grad_enabled():
            x = checkpoint(block, *inputs, **options, use_reentrant=False)
        else:
            x = block(*inputs, **options)
    return x


class TokenCalls:
    """How the network's inputs become tokens and its output predictions: shared by
    :class:`DiT` and a pipeline stage of it (both have ``config`` and ``token_multiple``)."""

    config: DiTConfig
    token_multiple: int

    def _read_text(self, text: Tensor | None) -> Tensor | None:
        """The text tokens the network reads: the first ``config.text_tokens`` (all if None)."""
        tokens = self.config.text_tokens
        return text if text is None or tokens is None else text[:, :tokens]

    # -- tokens ---------------------------------------------------------------------------
    def token_grid(self, latents: Tensor) -> Grid:
        """The patch grid of an image ``[B, C, h, w]`` (one frame) or a clip
        ``[B, C, F, h, w]``; a one-line error where the frames do not split into
        ``frame_patch`` or the positions cannot tell frames apart."""
        config = self.config
        if latents.dim() not in (4, 5):
            raise ValueError(
                f"DiT latents are [B, C, h, w] or [B, C, F, h, w], got {tuple(latents.shape)}"
            )
        frames = latents.shape[2] if latents.dim() == 5 else 1
        if frames % config.frame_patch:
            raise ValueError(
                f"model.dit.frame_patch {config.frame_patch} does not divide these latents' "
                f"{frames} frames; give clips of a multiple of {config.frame_patch} latent frames"
            )
        patch, pt = config.patch_size, config.frame_patch
        grid = Grid(frames // pt, latents.shape[-2] // patch, latents.shape[-1] // patch)
        if grid.frames > 1 and config.position != "rope":
            raise ValueError(
                f"model.dit.position {config.position} encodes rows and columns only, so the "
                "frames of a clip would look alike; use position: rope for clips"
            )
        return grid

    def _unpatchify(self, tokens: Tensor, like: Tensor, grid: Grid) -> Tensor:
        """``[B, grid tokens, C·pt·p·p]`` → latents shaped as ``like`` (an image or a clip)."""
        config = self.config
        frames = grid.frames if like.dim() == 5 else None
        return unpatchify(
            tokens, config.patch_size, config.in_channels, grid.rows, grid.cols, frames,
            config.frame_patch,
        )  # fmt: skip

    # -- entry points ---------------------------------------------------------------------
    def forward(
        self, x: Tensor | list[Tensor], timesteps: Tensor, text: Tensor | None, pooled: Tensor,
        capacity: int | None = None, kernel: str = "auto",
    ) -> Tensor | list[Tensor]:  # fmt: skip
        """``x`` latents, images ``[B, C, h, w]`` or clips ``[B, C, F, h, w]``, ``timesteps``
        ``[B]`` (or one for all), ``text`` ``[B, L, text_dim]`` tokens, ``pooled``
        ``[B, pooled_dim]`` → the prediction, shaped as ``x``. A list of groups of latents is
        a pack (:meth:`forward_packed`, whose arguments ``capacity`` and ``kernel`` are):
        called through ``forward``, so that what wraps the module (FSDP, DDP, hooks) sees both
        kinds of call."""
        call = self.prepare(x, timesteps, text, pooled, capacity, kernel)
        return call.finish(self._trunk(call))

    def forward_packed(
        self, groups: list[Tensor], timesteps: Tensor, text: Tensor | None, pooled: Tensor,
        capacity: int | None = None, kernel: str = "auto",
    ) -> list[Tensor]:  # fmt: skip
        """Samples of different shapes in one sequence (call it as ``self(groups, ...)``, see
        :meth:`forward`): ``groups`` of same-shaped latents, images ``[n_g, C, h_g, w_g]`` or
        clips ``[n_g, C, F_g, h_g, w_g]``; ``timesteps`` ``[N]``, ``text``
        ``[N, L, text_dim]`` and ``pooled`` ``[N, pooled_dim]`` for the N samples in group
        order. The pack holds ``capacity`` tokens (default: the next multiple of 128).
        Returns the predictions of each group, shaped as it."""
        call = self._prepare_packed(groups, timesteps, text, pooled, capacity, kernel)
        return call.finish(self._trunk(call))

    def prepare(
        self, x: Tensor | list[Tensor], timesteps: Tensor, text: Tensor | None, pooled: Tensor,
        capacity: int | None = None, kernel: str = "auto",
    ) -> TrunkCall:  # fmt: skip
        """The :class:`TrunkCall` of :meth:`forward`'s arguments (no weights read)."""
        if isinstance(x, list):
            return self._prepare_packed(x, timesteps, text, pooled, capacity, kernel)
        grid = self.token_grid(x)
        timesteps = timesteps.reshape(-1).expand(x.shape[0])  # one time for all, as a UNet takes
        if grid.num_tokens % self.token_multiple:
            call = self._prepare_packed([x], timesteps, text, pooled)
            return replace(call, finish=lambda out: call.finish(out)[0])
        attends = dense_attends(grid.frames, grid.cells)
        tokens = patchify(x, self.config.patch_size, self.config.frame_patch)
        return TrunkCall(
            tokens, grid_positions(grid.rows, grid.cols, grid.frames).to(x.device)[None],
            timesteps, self._read_text(text), pooled, attends, attends["full"], None,
            lambda out: self._unpatchify(out, x, grid), hidden_dtype(tokens),
        )  # fmt: skip

    def _prepare_packed(
        self, groups: list[Tensor], timesteps: Tensor, text: Tensor | None, pooled: Tensor,
        capacity: int | None = None, kernel: str = "auto",
    ) -> TrunkCall:  # fmt: skip
        text = self._read_text(text)
        config, device = self.config, groups[0].device
        grids = [self.token_grid(group) for group in groups]
        samples = [
            grid for grid, group in zip(grids, groups, strict=True) for _ in range(group.shape[0])
        ]
        pack = plan_pack(samples, capacity, device, self.token_multiple)
        tokens = torch.cat(
            [patchify(g, config.patch_size, config.frame_patch).flatten(0, 1) for g in groups]
        )
        padding = tokens.new_zeros(pack.capacity - pack.num_tokens, tokens.shape[-1])
        tokens = torch.cat([tokens, padding])[None]
        dtype = hidden_dtype(tokens)
        kernel = pick_kernel(kernel, device, dtype)
        text_length = text.shape[1] if text is not None else 1
        attention = PackAttention(pack, text_length, kernel, config.layouts)
        context = None if text is None else text.flatten(0, 1)[None]

        def finish(out: Tensor) -> list[Tensor]:
            predictions, start = [], 0
            for group, grid in zip(groups, grids, strict=True):
                length = group.shape[0] * grid.num_tokens
                piece = out[0, start : start + length].reshape(group.shape[0], grid.num_tokens, -1)
                predictions.append(self._unpatchify(piece, group, grid))
                start += length
            return predictions

        return TrunkCall(
            tokens, pack.positions[None], timesteps, context, pooled, attention.attends,
            attention.cross_attention, pack.document, finish, dtype,
        )  # fmt: skip


def hidden_dtype(tokens: Tensor) -> torch.dtype:
    """The dtype the blocks compute in: autocast's where it is on, else the tokens'."""
    device = tokens.device.type
    autocast = torch.amp.is_autocast_available(device)  # not on meta (FLOP counts)
    if autocast and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return tokens.dtype


class DiT(TokenCalls, nn.Module):
    """The diffusion transformer of :class:`DiTConfig`."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.hidden_size
        self.patch_embed = nn.Linear(config.patch_values, dim)
        self.time_embed = MLPEmbedder(FREQUENCY_DIM, dim, nn.SiLU())
        self.pooled_embed = MLPEmbedder(config.pooled_dim, dim, nn.SiLU())
        if config.has_text_tokens:
            self.text_embed = MLPEmbedder(config.text_dim, dim, nn.GELU(approximate="tanh"))
        if config.position == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(config.max_grid, config.max_grid, dim))
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final = FinalLayer(config)
        # Sequences are a multiple of this many tokens (tensor and context parallelism split
        # them over their groups): a batch whose images are not runs as a pack of that length.
        self.token_multiple = 1
        # Context parallelism (parallel.cp, set by the trainer): each rank of the group runs
        # the blocks on its shard of the sequence (impasto.models.sequence_parallel).
        self.sequence_parallel: SequenceParallel | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections, N(0, 0.02) embedders and positions, zero modulations and
        output (DiT's ``initialize_weights``); a llama block's cross output starts at zero."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        embedders = [self.time_embed, self.pooled_embed, getattr(self, "text_embed", None)]
        for embedder in filter(None, embedders):
            nn.init.normal_(embedder.linear_1.weight, std=0.02)
            nn.init.normal_(embedder.linear_2.weight, std=0.02)
        if self.config.position == "learned":
            nn.init.normal_(self.pos_embed, std=0.02)
        zeroed = [block.modulation for block in self.blocks]
        zeroed += [self.final.modulation, self.final.linear]
        if self.config.block == "llama":
            zeroed += [block.cross.to_out for block in self.blocks]
        for linear in zeroed:
            nn.init.zeros_(linear.weight)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)

    def enable_gradient_checkpointing(self) -> None:
        """Recompute every block's activations in backward instead of keeping them (diffusers'
        switch, which :mod:`impasto.train.memory` turns on and then off per block)."""
        for block in self.blocks.children():
            block.gradient_checkpointing = True

    # -- the shared trunk -----------------------------------------------------------------
    def _trunk(self, call: TrunkCall) -> Tensor:
        """The blocks over the call's tokens ``[B, S, C·pt·p·p]`` (:class:`TrunkCall`). Under
        context parallelism the blocks run on this rank's shard of the tokens, their positions
        and sample ids, and the output is gathered whole."""
        parallel = self.sequence_parallel
        if parallel is not None:
            call = replace(
                call,
                tokens=parallel.split(call.tokens, 1),
                positions=parallel.split(call.positions, 1),
                attends={layout: parallel.self_attention(a) for layout, a in call.attends.items()},
            )
            if call.document is not None:  # a pack: its cross-attention mask has a row per token
                call = replace(  # (a dense batch's has no mask)
                    call,
                    document=parallel.split(call.document, 0),
                    attend_cross=parallel.cross_attention(call.attend_cross),
                )
        x, rope = embed_tokens(self, call.tokens, call.positions)
        condition, context = conditioning(self, call, x.dtype)
        x = run_blocks(self.config, named_blocks(self.blocks), x, condition, rope, context, call)
        out = self.final(x, condition, call.document)
        return out if parallel is None else parallel.gather(out, 1)
