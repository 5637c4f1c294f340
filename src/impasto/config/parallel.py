"""The ``parallel`` config section: training on several processes (docs/distributed.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from impasto.config.section import Int, Section

MAX_RANKS = 65536  # ranks per HSDP shard group
MAX_TIMEOUT_S = 7 * 24 * 3600  # a collective waits at most a week


class ParallelConfig(Section):
    """Training on several processes (``torchrun``): docs/distributed.md."""

    strategy: Literal["none", "ddp", "fsdp", "hsdp"] = Field(
        "none",
        description="none: one process; ddp: full replicas, gradients all-reduced; fsdp: weights, "
        "gradients and optimizer state sharded over every rank (FSDP2); hsdp: sharded within "
        "a group of parallel.shard_size ranks (a node), replicated across groups",
    )
    reshard_after_forward: bool = Field(
        True,
        description="fsdp/hsdp: free each block's gathered weights after its forward and gather "
        "them again in backward (less memory, one more all-gather per block)",
    )
    param_dtype: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description="fsdp/hsdp: the dtype weights are gathered and computed in; auto: bf16 when "
        "the run computes in bf16, else fp32",
    )
    reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="fsdp/hsdp: the dtype gradients are reduced in"
    )
    shard_size: Int | None = Field(
        None,
        ge=1,
        le=MAX_RANKS,
        description="hsdp: ranks per shard group (default: the processes per node)",
    )
    tp: Int = Field(
        1,
        ge=1,
        le=MAX_RANKS,
        description="tensor parallelism: ranks that split each transformer block's attention "
        "and MLP projections (Megatron-LM's column/row split, with the token sequence split "
        "between them elsewhere); consecutive ranks form a group, so keep it within a node. "
        "Needs parallel.strategy fsdp or hsdp (sharded over the world / tp data-parallel "
        "ranks) and a family that has a plan (the diffusion transformer: docs/distributed.md)",
    )
    cp: Int = Field(
        1,
        ge=1,
        le=MAX_RANKS,
        description="context parallelism: ranks that split the token sequence of each sample "
        "(or pack), exchanging attention heads all-to-all (DeepSpeed-Ulysses), for sequences "
        "whose activations do not fit one GPU; each group is cp consecutive groups of "
        "parallel.tp ranks, so keep cp x tp within a node. Needs parallel.strategy fsdp or hsdp "
        "(weights sharded and gradients averaged over the world / tp ranks, the cp ranks "
        "among them), a family that has a plan (the diffusion transformer) and heads "
        "divisible by cp x tp: docs/distributed.md",
    )
    cp_mode: Literal["ulysses", "ring"] = Field(
        "ulysses",
        description="how full self-attention crosses a parallel.cp group: ulysses: an "
        "all-to-all gives each rank every token for heads / cp heads (one exchange of q, k, v "
        "and the output); ring: each rank keeps its queries and the key/value shards pass "
        "around the group (cp - 1 hops, and as many in backward), so no rank holds the whole "
        "sequence's keys and values, for sequences longer than one node holds. A pack's "
        "document mask is kept in both; spatial, temporal and cross-attention use the "
        "all-to-all in both (docs/distributed.md)",
    )
    pp: Int = Field(
        1,
        ge=1,
        le=MAX_RANKS,
        description="pipeline parallelism: stages that split the denoiser's blocks between them "
        "(each stage world / pp ranks), for models too large for tensor parallelism alone; the "
        "step's train.grad_accum_steps micro-batches flow through them (at least pp of them). "
        "The outermost dimension of the mesh (stages across nodes); composes with parallel.tp "
        "(each stage's blocks split over its tp groups). Needs parallel.strategy fsdp or hsdp "
        "(each stage sharded over its data-parallel ranks), objective.method denoise and a "
        "family that splits (the diffusion transformer): docs/distributed.md",
    )
    pp_schedule: Literal["1f1b", "gpipe"] = Field(
        "1f1b",
        description="parallel.pp: the order of the micro-batches' forwards and backwards; "
        "1f1b: one forward, one backward in the steady state (activations of at most pp "
        "micro-batches held); gpipe: all forwards, then all backwards",
    )
    timeout_s: Int = Field(
        1800,
        ge=10,
        le=MAX_TIMEOUT_S,
        description="how long a rank waits for the others in one collective",
    )


def check_pipeline(config: Any) -> None:
    """One-line errors for what ``parallel.pp`` > 1 does not compose with (``config``: the
    whole :class:`~impasto.config.schema.Config`)."""
    parallel = config.parallel
    pp = parallel.pp
    if pp == 1:
        return
    if parallel.strategy not in ("fsdp", "hsdp"):
        raise ValueError(
            f"parallel.pp {pp} splits the blocks inside a data-parallel run sharded by fsdp or "
            f"hsdp (per stage), not {parallel.strategy}; set parallel.strategy: fsdp"
        )
    refusals = {
        "parallel.cp": (parallel.cp > 1, "set parallel.cp: 1 (a stage runs whole sequences)"),
        "objective.method": (config.objective.method != "denoise", "pipelines run the denoise "
                             "method (one denoiser call per micro-batch); set parallel.pp: 1"),
        "sample.every_steps": (config.sample.every_steps > 0, "sampling runs the whole "
                               "denoiser on one rank; set it to 0 and sample the checkpoint"),
        "eval.every_steps": (config.eval.every_steps > 0, "the validation loss runs the whole "
                             "denoiser on one rank; set it to 0"),
        "memory.offload_blocks": (config.memory.offload_blocks, "set it to false (each stage "
                                  "holds a pp-th of the blocks already)"),
    }  # fmt: skip
    for name, (refused, fix) in refusals.items():
        if refused:
            raise ValueError(f"parallel.pp {pp} does not compose with {name}; {fix}")
    accum = config.train.grad_accum_steps
    if accum < pp:
        raise ValueError(
            f"parallel.pp {pp}: the step's train.grad_accum_steps {accum} micro-batches are too "
            f"few to fill {pp} stages; set train.grad_accum_steps to at least {pp}"
        )
