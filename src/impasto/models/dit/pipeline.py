"""A pipeline stage of the DiT (``parallel.pp``, issue #32): a contiguous run of its blocks,
with the embedders every stage needs (the seed's conditioning scheme).

Every stage holds its own copy of the time, pooled-text and text-token embedders and computes
the conditioning itself from the micro-batch's raw inputs (all stages of a data-parallel rank
read the same batch, so nothing but the hidden states travels between stages); the copies'
gradients are summed over the stages after backward (:mod:`impasto.train.pipeline_parallel`),
so they stay equal. The first stage alone holds the patch (and learned position) embedding,
the last the final layer.

Under ``parallel.tp`` the trainer splits a stage's blocks like the whole network's (the DiT's
tensor-parallel plan; a stage before the last gathers its blocks' output whole, so what
travels is the ``[B, S, D]`` of :meth:`DiTStage.io_meta` on every rank of the group).

A stage's parameters keep the whole network's names (``blocks.5.attn.to_q.weight``: the blocks
live in a dict keyed by their index), so a checkpoint written at any ``pp`` loads at any other.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from impasto.models.dit.network import (
    DiT,
    TokenCalls,
    TrunkCall,
    conditioning,
    embed_tokens,
    named_blocks,
    rope_rotation,
    run_blocks,
)

SHARED = ("time_embed.", "pooled_embed.", "text_embed.")
"""Parameter-name prefixes every stage holds a copy of (their gradients are summed)."""


def stage_blocks(num_layers: int, stage: int, num_stages: int) -> range:
    """The blocks of ``stage`` of ``num_stages``: contiguous, as even as they divide (the first
    stages take one more where they do not: they also hold the patch embedding, the last the
    final layer; both are small)."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"pipeline stage {stage} is outside 0..{num_stages - 1}")
    if num_stages > num_layers:
        raise ValueError(
            f"parallel.pp {num_stages} is more than the model's {num_layers} blocks; set "
            f"parallel.pp to at most {num_layers}"
        )
    size, extra = divmod(num_layers, num_stages)
    start = stage * size + min(stage, extra)
    return range(start, start + size + (stage < extra))


class DiTStage(TokenCalls, nn.Module):
    """Stage ``stage`` of ``num_stages`` of ``network`` (whose modules it takes over, under
    the same names). Called with the previous stage's hidden states (the first stage: the
    call's patches) and the micro-batch's :class:`~.network.TrunkCall`; returns the hidden
    states ``[B, S, D]`` (the last stage: the final layer's ``[B, S, C·pt·p·p]``)."""

    def __init__(self, network: DiT, stage: int, num_stages: int) -> None:
        super().__init__()
        config = network.config
        self.config = config
        self.token_multiple = network.token_multiple
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        if self.is_first:
            self.patch_embed = network.patch_embed
            if config.position == "learned":
                self.pos_embed = network.pos_embed
        self.time_embed = network.time_embed
        self.pooled_embed = network.pooled_embed
        if config.has_text_tokens:
            self.text_embed = network.text_embed
        indices = stage_blocks(config.num_layers, stage, num_stages)
        self.blocks = nn.ModuleDict({str(i): network.blocks[i] for i in indices})
        if self.is_last:
            self.final = network.final
        self.sequence_parallel = None  # parallel.cp does not compose with pp (config checks)

    def enable_gradient_checkpointing(self) -> None:
        for block in self.blocks.children():
            block.gradient_checkpointing = True

    def forward(self, x: Tensor, call: TrunkCall) -> Tensor:
        if self.is_first:
            x, rope = embed_tokens(self, x, call.positions)
        else:
            rope = None
            if self.config.position == "rope":
                rope = rope_rotation(call.positions, self.config.head_dim)
        condition, context = conditioning(self, call, x.dtype)
        x = run_blocks(self.config, named_blocks(self.blocks), x, condition, rope, context, call)
        if self.is_last:
            x = self.final(x, condition, call.document)
        return x.to(call.dtype)  # the dtype the next stage expects (autocast's)

    def io_meta(self, call: TrunkCall) -> tuple[Tensor, Tensor]:
        """This stage's input and output for ``call``, as meta tensors (shape and dtype)."""
        batch, length = call.tokens.shape[:2]
        hidden = torch.empty(batch, length, self.config.hidden_size, dtype=call.dtype,
                             device="meta")  # fmt: skip
        source = call.tokens.to("meta") if self.is_first else hidden
        patches = hidden.new_empty(batch, length, self.config.patch_values)
        return source, patches if self.is_last else hidden
