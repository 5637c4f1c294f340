"""Process groups for runs launched with ``torchrun`` (one process per device).

``torchrun`` sets ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` for every process; a plain
``python`` / ``impasto`` process is rank 0 of 1. Model code never imports ``torch.distributed``;
the parts that split work across ranks take ``(rank, world_size)`` as plain integers.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process, from torchrun's environment (else ``(0, 1)``)."""
    try:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        raise ValueError("RANK and WORLD_SIZE must be integers (set by torchrun)") from None
    if not 0 <= rank < world:
        raise ValueError(f"RANK {rank} is outside WORLD_SIZE {world}; launch with torchrun")
    return rank, world


@contextmanager
def process_group() -> Iterator[tuple[int, int]]:
    """Join the run's process group for the block (if ``WORLD_SIZE`` > 1); yields
    ``(rank, world_size)``. NCCL on CUDA machines, gloo otherwise."""
    rank, world = rank_and_world()
    owned = world > 1 and not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        yield rank, world
    finally:
        if owned:
            dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if dist.is_initialized():
        dist.barrier()


def gather_to_all(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order, on every rank."""
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


@dataclass(frozen=True)
class RunGroup:
    """Where this process stands in a run: its rank among ``world``, its device and (for
    ``fsdp`` / ``hsdp``) the device mesh. Rank 0 alone prints, logs and writes files.

    With tensor parallelism (``tp`` > 1) the mesh's last dimension, ``tp``, holds groups of
    ``tp`` consecutive ranks; with context parallelism (``cp`` > 1) the dimension before it,
    ``cp``, groups ``cp`` of those. The ``tp × cp`` consecutive ranks of a model group share
    one share of the data: the *data* rank and world (``data_rank``, ``data_world``) count
    those groups. With pipeline parallelism (``pp`` > 1) the mesh's first dimension, ``pp``,
    holds the stages (torchtitan's order: each stage is ``world / pp`` consecutive ranks); the
    ranks at one place of every stage read the same data."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    strategy: str = "none"
    mesh: DeviceMesh | None = None
    tp: int = 1
    cp: int = 1
    pp: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def model_ranks(self) -> int:
        """Ranks that train on the same data (``pp × tp × cp``; the ``tp × cp`` of a stage
        consecutive)."""
        return self.pp * self.tp * self.cp

    @property
    def stage_world(self) -> int:
        """Ranks of one pipeline stage (all of them without pipeline parallelism)."""
        return self.world // self.pp

    @property
    def data_rank(self) -> int:
        """Which share of every step's batch this rank trains on."""
        return self.rank % self.stage_world // (self.tp * self.cp)

    @property
    def data_world(self) -> int:
        """How many shares every step's batch splits into."""
        return self.world // self.model_ranks

    @property
    def data_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP shards the weights and averages the gradients over: every dimension
        but ``tp``, with ``shard`` and ``cp`` flattened into one (torchtitan's dp_shard_cp:
        the ranks of a context-parallel group hold the same weights and their gradients are
        the shards' parts of one gradient)."""
        if self.mesh is None or self.model_ranks == 1:
            return self.mesh
        if self.cp > 1:
            return data_cp_mesh(self.mesh)
        names = [name for name in self.mesh.mesh_dim_names if name not in ("tp", "pp")]
        return self.mesh[tuple(names)] if len(names) > 1 else self.mesh[names[0]]

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The tensor-parallel dimension of the mesh (None without tensor parallelism)."""
        return self.mesh["tp"] if self.mesh is not None and self.tp > 1 else None

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        """The pipeline-parallel dimension of the mesh (None without pipeline parallelism)."""
        return self.mesh["pp"] if self.mesh is not None and self.pp > 1 else None

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        """The context-parallel dimension of the mesh (None without context parallelism)."""
        return self.mesh["cp"] if self.mesh is not None and self.cp > 1 else None

    def data_sum(self, *counts: int) -> list[int]:
        """Counts of the data each rank read, summed over the data shares (the ranks of a
        model group read the same data: counted once)."""
        return [count // self.model_ranks for count in self.sum(*counts)]

    def data_gather(self, value: Any) -> list[Any]:
        """Every data share's ``value`` (picklable), in order, on every rank."""
        return self.gather(value)[: self.stage_world : self.tp * self.cp]

    @property
    def parallel(self) -> bool:
        return self.strategy != "none"

    def any(self, *flags: bool) -> list[bool]:
        """Each flag, true if it is true on any rank (one small all-reduce of a CPU tensor,
        through gloo: no device sync). In one process, the flags themselves."""
        if self.world == 1:
            return [bool(flag) for flag in flags]
        values = torch.tensor([int(flag) for flag in flags], dtype=torch.int32)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return [bool(value) for value in values.tolist()]

    def sum(self, *counts: int) -> list[int]:
        """Each count summed over the ranks (on the host)."""
        if self.world == 1:
            return list(counts)
        values = torch.tensor(counts, dtype=torch.int64)
        dist.all_reduce(values)
        return values.tolist()

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (a device tensor) averaged over the ranks."""
        if self.world == 1:
            return values
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.AVG if values.is_cuda else dist.ReduceOp.SUM)
        return values if values.is_cuda else values / self.world

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order, on every rank."""
        return gather_to_all(value) if self.world > 1 else [value]

    def barrier(self) -> None:
        if self.world > 1:
            barrier()

    def agree(self, what: str, value: Any, fix: str) -> None:
        """A one-line error on every rank when the ranks hold different ``value``s."""
        values = self.gather(value)
        odd = [rank for rank, other in enumerate(values) if other != values[0]]
        if odd:
            raise ValueError(
                f"ranks disagree on {what}: rank 0 has {values[0]}, rank {odd[0]} has "
                f"{values[odd[0]]}; {fix}"
            )


def run_device(device_option: str, local_rank: int) -> torch.device:
    """``train.device`` (auto, cpu, cuda, cuda:N) for this process of a parallel run: a CUDA
    run uses the GPU of its local rank."""
    from impasto.precision import resolve_device

    device = resolve_device(device_option)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def data_cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh``'s (shard, cp) dimensions flattened into ``shard_cp``, after ``replicate``
    where it has one (HSDP's 2-D mesh)."""
    shard_cp = mesh["shard", "cp"]._flatten("shard_cp")
    if "replicate" not in mesh.mesh_dim_names:
        return shard_cp
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is not None:  # torch >= 2.10, which warns of slicing a flattened dim
        return concatenate([mesh["replicate"], shard_cp])
    return mesh["replicate", "shard_cp"]


class MeshOptions(Protocol):
    """What :func:`run_group` reads of the ``parallel`` config section."""

    strategy: str
    timeout_s: int
    shard_size: int | None
    tp: int
    cp: int
    pp: int


@contextmanager
def run_group(parallel: MeshOptions, device_option: str) -> Iterator[RunGroup]:
    """Join the run's process group for the block and yield this process's :class:`RunGroup`
    (``parallel``: the config's section; its strategy, timeout, shard size, tp and cp).

    ``strategy`` none runs in one process (a one-line error under torchrun with several); the
    others start a group even for one process (so ``fsdp`` runs, and resumes, on 1 GPU): NCCL
    for CUDA tensors with gloo beside it for host flags, gloo alone on a CPU run. Ranks other
    than 0 print nothing (their stdout goes nowhere; errors still reach stderr)."""
    strategy, tp, cp, pp = parallel.strategy, parallel.tp, parallel.cp, parallel.pp
    rank, world = rank_and_world()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if strategy == "none":
        if world > 1:
            raise ValueError(
                f"parallel.strategy is none, but torchrun started {world} processes; set "
                "parallel.strategy: ddp (or fsdp, hsdp) to train on all of them"
            )
        from impasto.precision import resolve_device

        yield RunGroup(device=resolve_device(device_option))
        return
    device = run_device(device_option, local_rank)
    owned = not dist.is_initialized()
    if owned:
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=parallel.timeout_s)
        if "MASTER_ADDR" in os.environ:
            init_torchrun_group(backend, timeout, _device_id(device))
        else:  # one process started without torchrun
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        mesh = device_mesh(strategy, device, world, parallel.shard_size, tp, cp, pp)
        with contextlib.ExitStack() as stack:
            if rank:
                stack.enter_context(contextlib.redirect_stdout(stack.enter_context(
                    open(os.devnull, "w", encoding="utf-8")
                )))  # fmt: skip
            yield RunGroup(rank, world, device, strategy, mesh, tp, cp, pp)
    finally:
        if owned:
            dist.destroy_process_group()


def init_torchrun_group(
    backend: str, timeout: datetime.timedelta, device_id: torch.device | None = None
) -> None:
    """Join the process group of this torchrun attempt.

    Through a store prefixed with the attempt (``TORCHELASTIC_RESTART_COUNT``): with the plain
    ``env://`` store, workers restarted after a rank died (``--max-restarts``) read the gloo
    addresses the previous attempt's ranks published and fail to connect (torch 2.15)."""
    rank, world = rank_and_world()
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
        is_master=rank == 0 and not agent_hosts_store, timeout=timeout,
    )  # fmt: skip
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"/impasto/attempt_{attempt}", base)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timeout, device_id=device_id
    )


def _device_id(device: torch.device) -> torch.device | None:
    return device if device.type == "cuda" else None


def device_mesh(strategy: str, device: torch.device, world: int, shard_size: int | None,
                tp: int = 1, cp: int = 1, pp: int = 1) -> DeviceMesh | None:  # fmt: skip
    """``fsdp``: all ranks in one shard group; ``hsdp``: (replicas, shard_size), shard groups of
    consecutive ranks (one node each by default). ``ddp`` needs no mesh. ``tp`` > 1 adds a last
    dimension ``tp`` of consecutive ranks (within a node: its collectives run every layer);
    ``cp`` > 1 a dimension ``cp`` before it (an all-to-all per attention: within a node too);
    ``pp`` > 1 a first dimension ``pp`` (point-to-point sends of activations: across nodes)."""
    if world % pp:
        raise ValueError(
            f"parallel.pp: {pp} does not divide the {world} ranks; set it to a divisor of the "
            "world size"
        )
    stages = ((pp,), ("pp",)) if pp > 1 else ((), ())
    world //= pp  # the ranks of one stage
    split = tp * cp
    what = "parallel.tp" if cp == 1 else "parallel.cp" if tp == 1 else "parallel.tp x parallel.cp"
    if world % split:
        raise ValueError(
            f"{what}: {split} does not divide the {world} ranks; set it to a divisor of the "
            "world size (the GPUs of a node, usually)"
        )
    inner = [(size, name) for size, name in ((cp, "cp"), (tp, "tp")) if size > 1]
    sizes, names = tuple(size for size, _ in inner), tuple(name for _, name in inner)
    if strategy == "fsdp":
        return init_device_mesh(
            device.type, (*stages[0], world // split, *sizes),
            mesh_dim_names=(*stages[1], "shard", *names),
        )  # fmt: skip
    if strategy != "hsdp":
        return None
    size = shard_size or min(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if world % size or size % split:
        raise ValueError(
            f"parallel.shard_size: {size} does not divide the {world} ranks or is not a "
            f"multiple of {what} {split}; set it to the processes per node (or a divisor "
            "of the world size)"
        )
    return init_device_mesh(
        device.type, (*stages[0], world // size, size // split, *sizes),
        mesh_dim_names=(*stages[1], "replicate", "shard", *names),
    )  # fmt: skip
