"""Pipeline parallelism (``parallel.pp``) of a denoiser, from its family's
:class:`~impasto.models.backbone.PipelineStagePlan`, with ``torch.distributed.pipelining``.

Each stage of the ``pp`` dimension of the run's mesh holds a contiguous share of the blocks
(the family splits them, keeping the whole denoiser's parameter names, so checkpoints load at
any ``pp``). A step's ``train.grad_accum_steps`` micro-batches are the pipeline's: they flow
through the stages in a 1F1B (or GPipe) schedule, and the gradients are those of accumulating
them one by one (the schedule averages them as the loop would).

The seed's conditioning scheme: all stages of a data-parallel rank read the same batch and
run the training method's own code on it, so each stage computes the conditioning (time and
text embeddings) itself and only the hidden states travel between stages. The method does not
know it is pipelined: it calls the denoiser through an :class:`Endpoint`, which records the
call (a first pass on every stage, without gradients, whose prediction is a placeholder) and,
on the last stage, answers it with the pipeline's output (the method's step run again inside
the schedule's loss function, drawing the same numbers from a copy of its generator), so the
loss and metrics are the method's own. The copies of the embedders every stage holds get
their gradients summed over the stages after the schedule's backward, so they stay equal; the
gradient norm counts them once.

With tensor parallelism (``parallel.tp``) each stage's blocks are split over the stage's ``tp``
group before FSDP and the schedule (torchtitan's order; :mod:`impasto.train.tensor_parallel`),
and the hidden states travel whole between the stages: each rank of a ``tp`` group sends to
and receives from its counterparts (the ``pp`` dimension's groups). The embedders are whole on
every rank of a group and get equal gradients there, so their sum over the stages runs per
``tp`` position unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from impasto.distributed import RunGroup
from impasto.logging.flops import FlopMeter
from impasto.models.backbone import Backbone, PipelineStagePlan
from impasto.models.parts import Part
from impasto.train.methods import Method, Rows, StepOutput
from impasto.train.parallel import total_norm

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}  # parallel.pp_schedule


class MicroBatch(NamedTuple):
    """One micro-batch of a step, as the loop hands it over: the method's arguments, the
    seed of the global RNG it runs under (dropout) and what decides its FLOPs (its batch's
    shapes: the key of the loop's :class:`~impasto.logging.flops.FlopMeter`)."""

    batch: Any
    generator: torch.Generator
    rows: Rows
    seed: int
    shapes: Hashable = None


class Endpoint(nn.Module):
    """Stands in for the denoiser in the method's calls (see the module docstring): records
    the call as the stage's prepared micro-batch call, or answers with ``answer``. Attributes
    it lacks are the stage's (the method reads the denoiser's device and dtype)."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage
        self.recorded: Any = None
        self.answer: Any = None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("stage"), name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.answer is not None:
            return self.answer
        self.recorded = call = self.stage.prepare(*args, **kwargs)
        return call.finish(torch.zeros_like(call.tokens))  # a placeholder prediction


@dataclass
class PipelineSplit:
    """This rank's stage: its backbone and trained parts (the stage's), the backbone the
    method calls (its denoiser the :class:`Endpoint`) and the family's plan."""

    plan: PipelineStagePlan
    trainable: dict[str, Part]
    method_backbone: Backbone
    endpoint: Endpoint

    @property
    def backbone(self) -> Backbone:
        return self.plan.backbone


def split_pipeline(
    backbone: Backbone, trainable: dict[str, Part], group: RunGroup
) -> PipelineSplit:
    """This rank's stage of ``backbone`` (whose denoiser is taken apart; after the parts are
    prepared, so that every rank draws the adapters alike), or a one-line error where the
    family cannot split or a part other than the denoiser trains (each stage would hold a
    copy of it that sees a share of its gradient)."""
    denoiser = backbone.denoiser()
    others = [name for name, part in trainable.items() if part.module is not denoiser]
    if others:
        raise ValueError(
            f"parallel.pp {group.pp} trains the denoiser only, not parts.{others[0]}; set "
            f"parts.{others[0]}: frozen (or parallel.pp: 1)"
        )
    plan = backbone.pipeline_stage(group.pp_mesh.get_local_rank(), group.pp)
    if plan is None:
        raise ValueError(
            f"parallel.pp {group.pp}: the {backbone.family} family cannot split its denoiser "
            "into pipeline stages; set parallel.pp: 1 (fsdp shards its weights)"
        )
    stage = plan.backbone.denoiser()
    trainable = {name: replace(part, module=stage) for name, part in trainable.items()}
    endpoint = Endpoint(stage)
    return PipelineSplit(plan, trainable, plan.backbone.with_denoiser(endpoint), endpoint)


class PipelineRunner:
    """Runs a step's micro-batches through the stages (:meth:`run`) and measures the
    gradient norm over them (:meth:`grad_norm`)."""

    def __init__(
        self, split: PipelineSplit, method: Method, group: RunGroup,
        autocast: Callable[[], AbstractContextManager], schedule: str, num_microbatches: int,
    ) -> None:  # fmt: skip
        self.split, self.method, self.autocast = split, method, autocast
        self.stage_module = split.plan.backbone.denoiser()
        self.mesh = group.pp_mesh
        self.pp, self.device = group.pp, group.device
        self.schedule_class = SCHEDULES[schedule]
        self.num_microbatches = num_microbatches
        self.shared = [
            param for name, param in self.stage_module.named_parameters()
            if param.requires_grad and name.startswith(split.plan.shared)
        ]  # fmt: skip
        self.schedules: dict[tuple, Any] = {}  # by the activations' shapes
        self.calls: list[Any] = []
        self.micros: list[MicroBatch] = []
        self.results: dict[int, StepOutput] = {}

    def run(
        self, micros: list[tuple], meter: FlopMeter | None = None
    ) -> tuple[list[StepOutput], int]:
        """Forward and backward the step's micro-batches (each ``(batch, generator, rows,
        seed, shapes)``: :class:`MicroBatch`); returns each one's
        :class:`~impasto.train.methods.StepOutput` (loss detached), the same on every stage,
        and the FLOPs this rank ran for them (0 without a ``meter``): counted as the loop
        counts a micro-step's (once per step's shapes), so a pipelined run reports its
        devices' TFLOP/s as any other run does."""
        self.micros = micros = [MicroBatch(*micro) for micro in micros]
        key = ("pipeline", *(micro.shapes for micro in micros))
        with meter.measure(key) if meter is not None else contextlib.nullcontext():
            outputs = self.run_micros(micros)
        return outputs, (meter.flops(key) or 0) if meter is not None else 0

    def run_micros(self, micros: list[MicroBatch]) -> list[StepOutput]:
        endpoint, self.results = self.split.endpoint, {}
        templates, self.calls = [], []
        for micro in micros:  # every stage: the method's inputs to the denoiser
            torch.manual_seed(micro.seed)
            with torch.no_grad():
                templates.append(self.method.step(micro.batch, copied(micro.generator), micro.rows))
            self.calls.append(endpoint.recorded)
        metas = {self.key(call) for call in self.calls}
        if len(metas) > 1:
            raise ValueError(
                "parallel.pp: the micro-batches of a step have different shapes, and a pipeline "
                "sends one shape; set data.pack_tokens (packs are all one length)"
            )
        schedule = self.schedule(self.calls[0])
        first, last = self.split.plan.is_first, self.split.plan.is_last
        arg_mbs = [(call.tokens,) for call in self.calls] if first else None
        with self.autocast():
            schedule.step(
                arg_mbs=arg_mbs, kwarg_mbs=[{"call": call} for call in self.calls],
                target_mbs=list(range(len(micros))) if last else None,
                return_outputs=False,  # the loss function takes each output
            )  # fmt: skip
        self.sum_shared_grads()
        outputs = broadcast_outputs(
            [self.results.get(index, template) for index, template in enumerate(templates)],
            self.mesh.get_group(), self.pp - 1,
        )  # fmt: skip
        self.calls, self.micros, self.results = [], [], {}
        return outputs

    def key(self, call: Any) -> tuple:
        return tuple((tuple(meta.shape), meta.dtype) for meta in self.stage_module.io_meta(call))

    def schedule(self, call: Any) -> Any:
        """The schedule of this shape of activations (a stage's buffers have one shape)."""
        key = self.key(call)
        if key not in self.schedules:
            source, output = self.stage_module.io_meta(call)
            # Hidden states travel with their gradients (the first stage's input has none).
            source.requires_grad_(not self.split.plan.is_first)
            output.requires_grad_(True)
            stage = PipelineStage(
                self.stage_module, self.mesh.get_local_rank(), self.pp, self.device,
                input_args=source, output_args=output, group=self.mesh.get_group(),
            )  # fmt: skip
            self.schedules[key] = self.schedule_class(
                stage, self.num_microbatches, loss_fn=self.loss, scale_grads=True
            )
        return self.schedules[key]

    def loss(self, output: Tensor, index: int) -> Tensor:
        """The method's loss of micro-batch ``index`` given the last stage's ``output``: its
        step run again (same generator state and seed), the denoiser answered by ``output``."""
        micro, endpoint = self.micros[index], self.split.endpoint
        endpoint.answer = self.calls[index].finish(output)
        torch.manual_seed(micro.seed)
        try:
            with torch.autocast(self.device.type, enabled=False):  # the method enters its own
                out = self.method.step(micro.batch, copied(micro.generator), micro.rows)
        finally:
            endpoint.answer = None
        self.results[index] = StepOutput(out.loss.detach(), out.metrics)
        return out.loss

    def sum_shared_grads(self) -> None:
        """Sum the gradients of the embedders every stage holds over the stages (each stage's
        copy saw its own blocks' share): one all-reduce of their local shards over the ``pp``
        group (the ranks at one data-parallel and ``tp`` position, whose shards match)."""
        if not self.shared:
            return
        for param in self.shared:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [local(param.grad) for param in self.shared]
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        dist.all_reduce(flat, group=self.mesh.get_group())
        for grad, part in zip(grads, flat.split([grad.numel() for grad in grads]), strict=True):
            grad.copy_(part.view_as(grad))

    def grad_norm(self, grads: list[Tensor]) -> Tensor:
        """The 2-norm of the whole model's gradients: every stage's own, plus the shared
        embedders' once (their copies are equal after :meth:`sum_shared_grads`)."""
        shared = {id(param.grad) for param in self.shared}
        own = [grad for grad in grads if id(grad) not in shared]
        copies = [grad for grad in grads if id(grad) in shared]
        squares = squared_norm(own, self.device) + squared_norm(copies, self.device) / self.pp
        dist.all_reduce(squares, group=self.mesh.get_group())
        return squares.sqrt()


def squared_norm(grads: list[Tensor], device: torch.device) -> Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return total_norm(grads).float().square()


def local(tensor: Tensor) -> Tensor:
    """A sharded (DTensor) tensor's local shard; a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def copied(generator: torch.Generator) -> torch.Generator:
    """A generator in ``generator``'s state (the method draws alike from each copy)."""
    copy = torch.Generator(generator.device)
    copy.set_state(generator.get_state())
    return copy


def broadcast_outputs(
    outputs: list[StepOutput], group: dist.ProcessGroup, source: int
) -> list[StepOutput]:
    """Every micro-batch's loss and metrics as the last stage (``source``) measured them, on
    every stage (the others hold placeholders of the same shapes): one broadcast."""
    values = [value for out in outputs for value in (out.loss, *out.metrics.values())]
    flat = torch.cat([value.detach().float().reshape(-1) for value in values])
    dist.broadcast(flat, group=group, group_src=source)
    parts = iter(flat.split([value.numel() for value in values]))
    result = []
    for out in outputs:
        loss = next(parts).view_as(out.loss).to(out.loss.dtype)
        metrics = {name: next(parts).view_as(value) for name, value in out.metrics.items()}
        result.append(StepOutput(loss, metrics))
    return result
