"""Data parallelism on PyTorch's own engine (config section ``parallel``, docs/distributed.md).

- ``ddp``: each trained part is replicated (``torch.distributed._composable.replicate``, DDP's
  bucketed all-reduce, applied in place so the backbone keeps calling its own modules);
- ``fsdp``: FSDP2 ``fully_shard`` on every backbone block, then on each trained part's root
  (torchtitan's order: gradient checkpointing and compile are applied before, by
  :func:`~impasto.train.memory.apply_memory_options`); weights, gradients, optimizer state and
  the EMA are sharded over all ranks;
- ``hsdp``: the same over a 2-D mesh: sharded within a group (a node), replicated across.

Frozen parts (the VAE, frozen text encoders) stay whole on every rank: nothing to reduce.
Gradients are averaged over the ranks, so a step's update is the one of the global batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from torch import nn

from impasto.config.schema import ParallelConfig
from impasto.distributed import RunGroup
from impasto.models.backbone import Backbone
from impasto.models.parts import Part

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def apply_strategy(
    backbone: Backbone,
    trainable: dict[str, Part],
    parallel: ParallelConfig,
    group: RunGroup,
    compute_dtype: torch.dtype | None,
) -> list[nn.Module]:
    """Wrap the trained parts for ``parallel.strategy`` in place; returns the wrapped roots
    (whose gradient sync :func:`set_gradient_sync` turns off on inner micro-steps)."""
    if parallel.strategy == "none":
        return []
    roots = [part.module for part in trainable.values()]
    classes = [type(module) for module in roots]
    try:
        wrap(backbone, roots, parallel, group, compute_dtype)
    finally:
        for module, original in zip(roots, classes, strict=True):
            keep_output_capture(module, original)
    return roots


def wrap(
    backbone: Backbone,
    roots: list[nn.Module],
    parallel: ParallelConfig,
    group: RunGroup,
    compute_dtype: torch.dtype | None,
) -> None:
    if parallel.strategy == "ddp":
        from torch.distributed._composable import replicate

        options = {"device_id": group.device} if group.device.type == "cuda" else {}
        # No buffer broadcast in forward (the ranks' buffers are equal; sampling on all ranks
        # must not need a collective): forward_sync_buffers, broadcast_buffers before torch 2.15.
        ddp_options = inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
        sync = (
            "forward_sync_buffers" if "forward_sync_buffers" in ddp_options else "broadcast_buffers"
        )
        options[sync] = False
        for module in roots:
            replicate(module, **options)
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param_dtype = compute_dtype if parallel.param_dtype == "auto" else DTYPES[parallel.param_dtype]
    if param_dtype == torch.float32:
        param_dtype = None  # the weights' own dtype: no cast
    reduce_dtype = DTYPES[parallel.reduce_dtype]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    options = {"mesh": group.data_mesh, "mp_policy": policy}
    denoiser = backbone.denoiser()
    for module in roots:
        if module is denoiser:
            for block in backbone.blocks().values():
                fully_shard(block, reshard_after_forward=parallel.reshard_after_forward, **options)
        # The root's own weights are gathered at the start of forward and needed again at once
        # at the end of backward: keeping them is torchtitan's default.
        fully_shard(module, reshard_after_forward=False, **options)


def keep_output_capture(module: nn.Module, original: type) -> None:
    """``replicate`` and ``fully_shard`` give a module a new class (a subclass of its own), and
    transformers looks up which outputs a model can record (``output_hidden_states``, which
    SDXL's text encoders need) by the class's name: register the new class like the old."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # an older transformers, which does not look outputs up by class
        return
    flags = dict.get(_CAN_RECORD_REGISTRY, str(original))
    if type(module) is not original and flags is not None:
        dict.__setitem__(_CAN_RECORD_REGISTRY, str(type(module)), flags)


def set_gradient_sync(roots: Iterable[nn.Module], sync: bool) -> None:
    """Reduce gradients across ranks in the coming backward (the last micro-step of a step) or
    only accumulate them locally (the inner ones)."""
    for module in roots:
        module.set_requires_gradient_sync(sync)


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) scalar as a plain tensor (its reduction over the ranks)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def by_mesh(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by the device mesh they are sharded over (plain tensors: one group).
    With tensor parallelism some weights span the data and ``tp`` dimensions and others the
    data dimensions only, and one ``foreach`` kernel takes one mesh."""
    groups: dict[object, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(getattr(tensor, "device_mesh", None), []).append(tensor)
    return list(groups.values())


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``grads`` over every rank's shards, as a plain 0-dim tensor."""
    groups = by_mesh(grads)
    if len(groups) <= 1:
        return full_value(torch.nn.utils.get_total_norm(grads))
    norms = [full_value(torch.nn.utils.get_total_norm(group)) for group in groups]
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_with_norm(params: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """``clip_grads_with_norm_`` for weights sharded over several meshes."""
    for group in by_mesh(params):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)


def scale_grads(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every gradient by the 0-dim ``factor`` in place (mesh by mesh)."""
    for group in by_mesh(grads):
        torch._foreach_mul_(group, factor.to(group[0].dtype))
