"""What one optimizer step needs, built from a config: the trainer and ``impasto bench`` share
it, so the benchmark times exactly the step that trains."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from impasto.checkpoint.trained import build_starting_backbone
from impasto.config import Config
from impasto.data import Batch
from impasto.distributed import RunGroup
from impasto.models.backbone import Backbone
from impasto.models.parts import (
    Part,
    init_adapters_from_kohya,
    param_groups,
    prepare_parts,
    set_train_mode,
)
from impasto.precision import autocast_factory
from impasto.train.ema import EMA
from impasto.train.fused import FusedBackwardOptimizer
from impasto.train.memory import (
    apply_memory_options,
    attention_context,
    combined,
    set_weight_dtypes,
)
from impasto.train.methods import WHOLE_STEP, Method, MethodContext, Rows, build_method
from impasto.train.offload import BlockOffload
from impasto.train.optim import OPTIMIZERS
from impasto.train.parallel import (
    apply_strategy,
    clip_with_norm,
    scale_grads,
    set_gradient_sync,
    total_norm,
)
from impasto.train.quantize import (
    check_device_kernel,
    check_quantized_base,
    is_quantized,
    quantize_frozen_base,
)

if TYPE_CHECKING:
    from impasto.train.pipeline_parallel import PipelineRunner


@dataclass
class StepSetup:
    """The backbone, what trains in it, the training method and how a step runs."""

    backbone: Backbone
    trainable: dict[str, Part]
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer | FusedBackwardOptimizer
    fused: FusedBackwardOptimizer | None
    method: Method
    ema: EMA | None
    autocast: object  # a context factory: autocast and the attention kernel
    offload: BlockOffload | None = None
    parallel_roots: list[torch.nn.Module] = field(default_factory=list)  # ddp/fsdp-wrapped
    pipeline: PipelineRunner | None = None  # parallel.pp: runs a step's micro-batches at once

    def micro_step(
        self,
        batch: Batch,
        generator: torch.Generator,
        scale: float = 1.0,
        rows: Rows = WHOLE_STEP,
        sync: bool = True,
    ):
        """Forward and backward one micro-batch (loss × ``scale``); returns the method's
        :class:`~impasto.train.methods.StepOutput` with the loss detached. ``rows``: the
        micro-batch's place in the step's global batch; ``sync``: reduce the gradients across
        ranks in this backward (the step's last micro-batch) or only accumulate them."""
        set_gradient_sync(self.parallel_roots, sync)
        out = self.method.step(batch, generator, rows)
        (out.loss * scale).backward()
        return type(out)(out.loss.detach(), out.metrics)

    def update(self, max_grad_norm: float | None) -> tuple[Tensor, Tensor]:
        """Clip and step; returns (grad norm, finite) as 0-dim device tensors, read by nobody
        until a logging step: no host sync here.

        A non-finite gradient never reaches the weights: optimizers that can skip on the
        device (torch's fused Adam/AdamW, ``found_inf`` as under a GradScaler) skip the step;
        the others step on zeroed gradients, as fused backward does per parameter (see
        :mod:`impasto.train.fused`, where the parameters stepped inside backward already)."""
        if self.fused is not None:
            grad_norm, nonfinite = self.fused.finish_step()
            return grad_norm, nonfinite == 0
        norm_of = self.pipeline.grad_norm if self.pipeline is not None else total_norm
        return clip_and_step(self.optimizer, self.params, max_grad_norm, norm_of)


def clip_and_step(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
    max_grad_norm: float | None, norm_of: Callable[[list[Tensor]], Tensor] = total_norm,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``clip_grad_norm_`` then ``step`` and ``zero_grad``, unless the gradient norm is not
    finite: then the weights do not see the gradients (see :meth:`StepSetup.update`).
    ``norm_of``: the gradients' norm over every rank (a pipeline's counts every stage)."""
    grads = [param.grad for param in params if param.grad is not None]
    norm = norm_of(grads)  # sharded grads: over all ranks
    finite = torch.isfinite(norm)
    if getattr(optimizer, "_step_supports_amp_scaling", False):  # fused: skips in the kernel
        if max_grad_norm is not None:
            clip_with_norm(params, max_grad_norm, norm)
        optimizer.grad_scale, optimizer.found_inf = None, (~finite).float()
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
    else:
        zero_unless_finite(params, grads, norm, finite, max_grad_norm)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, finite


def zero_unless_finite(
    params: list[torch.nn.Parameter],
    grads: list[Tensor],
    norm: Tensor,
    finite: Tensor,
    max_grad_norm: float | None,
) -> None:
    """Clip the gradients to ``max_grad_norm`` where their norm is finite, else make them all 0,
    in two passes and no host sync. Finite gradients come out bit for bit as
    ``clip_grad_norm_`` leaves them (sanitising changes none of them)."""
    for grad in grads:
        grad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    if max_grad_norm is None:
        scale_grads(grads, finite)
        return
    # An infinite norm makes the clipping coefficient max_norm / (inf + eps) = 0 exactly.
    norm = torch.where(finite, norm, torch.inf)
    clip_with_norm(params, max_grad_norm, norm)


def build_step_setup(
    config: Config,
    device: torch.device,
    precision: torch.dtype | None,
    group: RunGroup | None = None,
) -> StepSetup:
    """Build the backbone, make the configured parts trainable, apply the memory options and
    the parallel strategy (``group``: this process in a torchrun job), and build the optimizer,
    method and EMA. Seeds the global RNG (adapters initialise from it: every rank alike)."""
    group = group or RunGroup(device=device)
    check_quantized_base(config, device)  # before anything large is built
    torch.manual_seed(config.train.seed)
    backbone = build_starting_backbone(config)
    trainable = prepare_parts(config, backbone)
    if config.lora.init_from:
        count = init_adapters_from_kohya(trainable, config.lora)
        print(f"impasto: started {count} LoRA layers from {config.lora.init_from}")
    pipeline = None
    if group.pp > 1:  # this rank's stage (adapters drawn alike on every rank: before it)
        from impasto.train.pipeline_parallel import PipelineRunner, split_pipeline

        pipeline = split_pipeline(backbone, trainable, group)
        backbone, trainable = pipeline.backbone, pipeline.trainable
    set_train_mode(trainable, backbone)
    memory = config.memory
    mixed = config.train.mixed_precision
    quantized = is_quantized(memory.frozen_dtype)
    # float8/int8: the other frozen weights as bf16 holds them (under bf16 autocast only)
    others = ("bf16" if mixed == "bf16" else "fp32") if quantized else memory.frozen_dtype
    set_weight_dtypes(backbone, mixed, memory.vae_dtype, others)
    if quantized:  # on the host: the device never holds the full-precision base
        compute = torch.bfloat16 if mixed in ("bf16", "pure_bf16") else precision
        check_device_kernel(memory.frozen_dtype, device, compute)
        quantize_frozen_base(trainable, memory.frozen_dtype, compute)
    backbone.to(device)
    autocast = combined(
        autocast_factory(device, precision), attention_context(config.memory.attention)
    )
    # The method is built before the memory options and the strategy wrap the networks: a
    # method that keeps a frozen copy of the starting model (draftp) copies plain modules.
    # Under parallel.pp the method calls the denoiser through the pipeline's endpoint.
    called = pipeline.method_backbone if pipeline is not None else backbone
    method = build_method(
        MethodContext(config, called, tuple(trainable), autocast, group.data_rank, group.data_world)
    )
    # torchtitan's order: tensor, then context parallelism, checkpointing, compile, fsdp
    if group.tp > 1:
        from impasto.train.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(backbone, group.tp_mesh)
    if group.cp > 1:
        from impasto.train.context_parallel import apply_context_parallel

        apply_context_parallel(backbone, group.cp_mesh, group.tp, config.parallel.cp_mode)
    apply_memory_options(backbone, config.memory)
    roots = apply_strategy(backbone, trainable, config.parallel, group, precision)
    offload = None
    if config.memory.offload_blocks:  # after dtypes and layout, before the optimizer
        offload = BlockOffload(
            backbone.denoiser(), backbone.blocks(), device, resident=config.memory.resident_blocks
        )
    runner = None
    if pipeline is not None:
        accum, schedule = config.train.grad_accum_steps, config.parallel.pp_schedule
        runner = PipelineRunner(pipeline, method, group, autocast, schedule, accum)
    groups = param_groups(trainable)
    build = partial(OPTIMIZERS[config.optim.name], config=config.optim)
    fused = FusedBackwardOptimizer(groups, build) if config.memory.fused_backward else None
    return StepSetup(
        backbone=backbone,
        trainable=trainable,
        params=[param for group in groups for param in group["params"]],
        optimizer=fused or build(groups),
        fused=fused,
        method=method,
        ema=build_ema(config, trainable),
        autocast=autocast,
        offload=offload,
        parallel_roots=roots,
        pipeline=runner,
    )


def build_ema(config: Config, parts: dict[str, Part]) -> EMA | None:
    """The EMA of every trained parameter (``ema.enabled``), named ``part.parameter``."""
    ema = config.ema
    if not ema.enabled:
        return None
    named = [
        (f"{name}.{param_name}", param)
        for name, part in parts.items()
        for param_name, param in part.module.named_parameters()
        if param.requires_grad
    ]
    return EMA(named, ema.decay, ema.warmup, ema.inv_gamma, ema.power, ema.update_every, ema.device)
