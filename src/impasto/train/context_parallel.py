"""Context parallelism (``parallel.cp``) of a denoiser, from its family's
:class:`~impasto.models.backbone.ContextParallelPlan`: DeepSpeed-Ulysses (Jacobs et al. 2023,
arXiv:2309.14509) over the ``cp`` dimension of the run's mesh.

The model side (where the sequence is split, the heads exchanged and the output gathered, and
why the gradients come out right) is :mod:`impasto.models.sequence_parallel`; this module gives
it the group's exchanges as functional collectives (differentiable, and traced by
``torch.compile`` like DTensor's own) and checks what the split needs.

Ulysses keeps every rank's attention over the whole sequence (for ``H / cp`` heads), so a
pack's document mask and a spatiotemporal model's frame and patch groups stay valid; it
needs the heads (each tensor-parallel rank's share of them) to divide by ``cp``, and moves
each attention's queries, keys, values and output once through an all-to-all.
``parallel.cp_mode: ring`` runs full self-attention as ring attention instead
(:mod:`impasto.models.ring_attention`): key/value shards passed to the next rank of the group
by point-to-point sends (``batch_isend_irecv``: NCCL on the GPU, gloo on the CPU), for
sequences whose keys and values one rank cannot hold whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from impasto.models.backbone import Backbone, ContextParallelPlan
from impasto.models.sequence_parallel import SequenceParallel

# torch >= 2.14 renames the all-gather (the old name warns); both reduce-scatter in backward.
_all_gather = (
    getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
)


class MeshCollectives:
    """The :class:`~impasto.models.sequence_parallel.Collectives` of one mesh dimension."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group = mesh.get_group()
        self.rank = mesh.get_local_rank()
        self.size = mesh.size()

    def all_to_all(self, chunks: Tensor) -> Tensor:
        return funcol.all_to_all_single_autograd(chunks, None, None, self.group)

    def all_gather(self, x: Tensor) -> Tensor:
        return _all_gather(x.unsqueeze(0).contiguous(), 0, self.group)

    def ring_shift(self, x: Tensor) -> Callable[[], Tensor]:
        x = x.contiguous()
        received = torch.empty_like(x)
        following, previous = (
            dist.get_global_rank(self.group, (self.rank + step) % self.size) for step in (1, -1)
        )
        requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, x, following, self.group),
            dist.P2POp(dist.irecv, received, previous, self.group),
        ])  # fmt: skip

        def wait() -> Tensor:
            for request in requests:
                request.wait()
            return received

        return wait


def check_context_plan(
    plan: ContextParallelPlan | None, family: str, cp: int, tp: int = 1
) -> ContextParallelPlan:
    """The plan, or a one-line error when the family has none or ``cp`` does not divide what
    each tensor-parallel rank holds of the counts it splits (the heads)."""
    if plan is None:
        raise ValueError(
            f"parallel.cp {cp}: the {family} family has no context-parallel plan (its denoiser "
            "is not a transformer over a token sequence); set parallel.cp: 1"
        )
    for what, count in plan.divisible.items():
        if count % (tp * cp):
            held = f"the model's {count} {what}" if tp == 1 else (
                f"the {count // tp} {what} of each parallel.tp rank ({count} / tp {tp})"
            )  # fmt: skip
            raise ValueError(
                f"parallel.cp {cp} does not divide {held}; set parallel.cp to a divisor of them"
            )
    return plan


def apply_context_parallel(
    backbone: Backbone, mesh: DeviceMesh, tp: int = 1, mode: str = "ulysses"
) -> None:
    """Split the backbone's denoiser's sequence over ``mesh`` (the run's ``cp`` dimension) in
    place, full self-attention by ``mode`` (``parallel.cp_mode``: ulysses or ring); after
    tensor parallelism (``tp``: its group size), before checkpointing, compile and FSDP
    (torchtitan's order)."""
    cp = mesh.size()
    plan = check_context_plan(backbone.context_parallel_plan(), backbone.family, cp, tp)
    denoiser = backbone.denoiser()
    setattr(denoiser, plan.hook, SequenceParallel(MeshCollectives(mesh), mode))
    if plan.token_multiple:  # tensor parallelism's multiple (tp), times cp
        setattr(denoiser, plan.token_multiple, getattr(denoiser, plan.token_multiple) * cp)
