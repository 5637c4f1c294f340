"""Tensor and sequence parallelism (``parallel.tp``) of a denoiser, from its family's
:class:`~impasto.models.backbone.TensorParallelPlan`, with ``torch.distributed.tensor.parallel``.

Megatron-LM's scheme (Shoeybi et al. 2019; Korthikanti et al. 2022 for the sequence part), as
torchtitan applies it to Llama:

- between the blocks' layers every rank of the group holds a slice of the token sequence
  (``[B, S / tp, D]``); norms, adaLN modulation, gates and residual adds run on that slice;
- before attention and the MLP the sequence is all-gathered; the q, k, v and first MLP
  projections are split by columns, so each rank computes its slice of the heads (attention
  needs no communication: a head sees the whole sequence) and of the MLP's hidden features;
- the output projections are split by rows, and their partial sums are reduce-scattered back
  to the sequence slices.

Weights of split layers are ``DTensor`` s on the ``tp`` dimension of the run's mesh; FSDP then
shards them (and every other weight) over the data-parallel dimensions (torchtitan's order:
tensor parallelism, activation checkpointing, compile, ``fully_shard``). Norm weights that
read a slice (QK norm over a slice of the heads; affine norms over a slice of the sequence)
are replicated ``DTensor`` s, so their gradients are summed over the group; the per-sample
modulation vectors, whole on every rank, get their gradients summed by :class:`SumGradients`.

Under pipeline parallelism (``parallel.pp``) this splits each stage's own blocks on the stage's
``tp`` group (torchtitan's order: tensor parallelism per stage, then FSDP, then the schedule).
The sequence enters a stage whole and is split at its first block; a stage without the output
layer gathers its last block's slices whole, so the hidden states that travel between stages
are the full ``[B, S, D]`` on every rank of a ``tp`` group (the next stage's split of them
all-gathers their gradient in backward: whole on every rank again).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from impasto.models.backbone import Backbone, TensorParallelPlan

SEQUENCE = Shard(1)  # [B, S, ...]: split along the tokens
HEADS = 2  # [B, S, H, Dh]: the heads' axis, split after a column-wise projection


def check_plan(plan: TensorParallelPlan | None, family: str, tp: int) -> TensorParallelPlan:
    """The plan, or a one-line error when the family has none or ``tp`` does not divide the
    features it splits."""
    if plan is None:
        raise ValueError(
            f"parallel.tp {tp}: the {family} family has no tensor-parallel plan; set "
            "parallel.tp: 1 (fsdp shards its weights without it)"
        )
    for what, count in plan.divisible.items():
        if count % tp:
            raise ValueError(
                f"parallel.tp {tp} does not divide the model's {count} {what}; set parallel.tp "
                "to a divisor of it"
            )
    return plan


def apply_tensor_parallel(backbone: Backbone, mesh: DeviceMesh) -> None:
    """Split the backbone's denoiser over ``mesh`` (the run's ``tp`` dimension) in place."""
    plan = check_plan(backbone.tensor_parallel_plan(), backbone.family, mesh.size())
    denoiser = backbone.denoiser()
    for block in plan.blocks:
        parallelize_module(block, mesh, block_styles(block, plan))
        for name in plan.conditioned:
            module = block.get_submodule(name)
            module.register_forward_hook(sum_gradients_hook(mesh.get_group()))
        if plan.token_index is not None:
            block.register_forward_pre_hook(
                split_tokens_hook(plan.token_index, mesh.get_local_rank(), mesh.size()),
                with_kwargs=True,
            )
    first = plan.blocks[0]  # the whole sequence in, each rank's slice out
    entry = relayout_first(positional_arguments(first), Replicate(), SEQUENCE)
    parallelize_module(first, mesh, entry)
    output = dict(denoiser.named_modules()).get(plan.output)
    if output is None:  # a pipeline stage before the last: the hidden states leave it whole
        plan.blocks[-1].register_forward_hook(gather_sequence_hook(mesh.get_group()))
    else:  # the slices gathered whole again before the output layer
        gather = relayout_first(positional_arguments(output), SEQUENCE, Replicate())
        parallelize_module(output, mesh, gather)
    if plan.token_multiple:
        setattr(denoiser, plan.token_multiple, mesh.size())


def block_styles(block: nn.Module, plan: TensorParallelPlan) -> dict[str, object]:
    """``parallelize_module``'s plan for one block: the plan's names this block has."""
    modules = dict(block.named_modules())
    styles: dict[str, object] = {}
    for name in plan.gathers:
        if name in modules:
            count = positional_arguments(modules[name])
            styles[name] = relayout_first(count, SEQUENCE, Replicate())
    for name in (*plan.colwise, *plan.rowwise):
        if name in modules and type(modules[name]) is not nn.Linear:
            raise ValueError(
                f"parallel.tp splits plain linear layers, but {name} is a "
                f"{type(modules[name]).__name__} (LoRA adapters?); train the part full or set "
                "parallel.tp: 1 (a LoRA run's weights fit without it)"
            )
    styles |= {name: ColwiseParallel() for name in plan.colwise if name in modules}
    styles |= {
        name: RowwiseParallel(output_layouts=SEQUENCE) for name in plan.rowwise if name in modules
    }
    weighted = [name for name in modules if has_parameters(modules[name])]
    styles |= {
        name: SequenceParallel(sequence_dim=HEADS, use_local_output=True)
        for name in plan.head_norms
        if name in weighted
    }
    styles |= {
        name: SequenceParallel(use_local_output=True)
        for name in plan.sequence_norms
        if name in weighted
    }
    return styles


def has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def positional_arguments(module: nn.Module) -> int:
    """How many positional arguments the module's callers pass: its forward's parameters
    before the first with a default (``PrepareModuleInput`` wants a layout for each)."""
    parameters = inspect.signature(module.forward).parameters.values()
    return sum(
        1
        for parameter in parameters
        if parameter.default is inspect.Parameter.empty
        and parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    )


def relayout_first(count: int, source: object, target: object) -> PrepareModuleInput:
    """The first of ``count`` positional inputs moved from layout ``source`` to ``target``:
    whole (``Replicate``) to each rank's slice of the sequence (no communication; the
    gradient is all-gathered in backward), or the slices all-gathered whole."""
    rest = [None] * (count - 1)
    return PrepareModuleInput(
        input_layouts=(source, *rest), desired_input_layouts=(target, *rest), use_local_output=True
    )


class SumGradients(torch.autograd.Function):
    """The identity forward; backward, the gradient summed over the group (Megatron's ``f``
    for a tensor every rank holds whole but uses on its slice of the sequence only)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # noqa: ANN001
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_gradients_hook(group: dist.ProcessGroup):  # noqa: ANN201
    def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        return SumGradients.apply(output, group)

    return hook


class GatherSequence(torch.autograd.Function):
    """Each rank's slice of the sequence (dim 1) all-gathered whole; backward, this rank's
    slice of the gradient (whole and equal on every rank of the group: the next pipeline
    stage's split all-gathers it). ``DTensor``'s own relayout does the same but returns a
    view, which FSDP warns of as a module's output."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # noqa: ANN001
        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        x = x.contiguous()
        slices = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(slices, x, group=group)
        return torch.cat(slices, dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        return grad.chunk(ctx.size, dim=1)[ctx.rank].contiguous(), None


def gather_sequence_hook(group: dist.ProcessGroup):  # noqa: ANN201
    def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        return GatherSequence.apply(output, group)

    return hook


def split_tokens_hook(name: str, rank: int, size: int):  # noqa: ANN201
    """A block's per-token index argument ``name`` cut to this rank's slice of the sequence."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        index = kwargs.get(name)
        if index is None:
            return None
        return args, {**kwargs, name: index.chunk(size)[rank]}

    return hook
