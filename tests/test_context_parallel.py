"""Context parallelism (``parallel.cp``, issue #32): Ulysses all-to-all and ring attention
(``parallel.cp_mode``) over the DiT's sequence.

Fast tests run a group of ranks as threads of this process (:class:`ThreadGroup`, the
exchanges of :class:`~impasto.models.sequence_parallel.Collectives` through shared memory):
the all-to-all's layout, and a DiT split over 2 or 4 "ranks" predicting what one does, with
gradients whose mean over the ranks (what FSDP's average over the data x cp ranks makes) is
one process's, for packs of mixed shapes (full and ST-DiT attention, grouped and masked SDPA
kernels) and dense batches, in both modes. The slow tests train with torchrun on CPU (gloo):
cp 2 equals one process after 3 steps for a packed ``full`` DiT (all-to-all and ring) and
for an ST-DiT on clips, tp 2 x a ring of cp 2 too, and a cp 2 checkpoint resumes at cp 1.
Every launch sets OMP_NUM_THREADS=1. The ring's own math: tests/test_ring_attention.py.
"""

from __future__ import annotations

import copy
import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist_helpers import assert_same_training, in_process, launch_plan, losses
from PIL import Image
from torch import Tensor

from impasto.checkpoint.sharded import is_sharded
from impasto.config import build_config
from impasto.distributed import RunGroup
from impasto.models import build_backbone, sequence_parallel
from impasto.models.dit.network import DiT, DiTConfig
from impasto.models.sequence_parallel import SequenceParallel
from impasto.train.context_parallel import check_context_plan
from impasto.train.tensor_parallel import check_plan


# -- a group of threads -----------------------------------------------------------------------
class ThreadGroup:
    """``size`` threads that swap tensors: every rank's value, on every rank."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=120)
        self.slots: list[Any] = [None] * size

    def swap(self, rank: int, value: Tensor) -> list[Tensor]:
        self.slots[rank] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # nobody writes the next exchange's value before all have read
        return values


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, chunks: Tensor, group: ThreadGroup, rank: int) -> Tensor:  # noqa: ANN001
        ctx.group, ctx.rank = group, rank
        sent = group.swap(rank, chunks)
        return torch.stack([chunk[rank] for chunk in sent])

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        sent = ctx.group.swap(ctx.rank, grad)
        return torch.stack([chunk[ctx.rank] for chunk in sent]), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: ThreadGroup, rank: int) -> Tensor:  # noqa: ANN001
        ctx.group, ctx.rank = group, rank
        return torch.stack(group.swap(rank, x))

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        grads = ctx.group.swap(ctx.rank, grad)
        return sum(other[ctx.rank] for other in grads), None, None  # a reduce-scatter


class ThreadCollectives:
    """:class:`~impasto.models.sequence_parallel.Collectives` of one thread of a group."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def all_to_all(self, chunks: Tensor) -> Tensor:
        return _AllToAll.apply(chunks, self.group, self.rank)

    def all_gather(self, x: Tensor) -> Tensor:
        return _AllGather.apply(x, self.group, self.rank)

    def ring_shift(self, x: Tensor) -> Callable[[], Tensor]:
        received = self.group.swap(self.rank, x)[(self.rank - 1) % self.size]
        return lambda: received


def on_threads(
    size: int, work: Callable[[SequenceParallel, int], Any], mode: str = "ulysses"
) -> list[Any]:
    """``work(parallel, rank)`` on ``size`` threads, one rank each (``mode``: the
    context-parallel mode); the results in rank order."""
    group, results, errors = ThreadGroup(size), [None] * size, []

    def run(rank: int) -> None:
        try:
            parallel = SequenceParallel(ThreadCollectives(group, rank), mode)
            results[rank] = work(parallel, rank)
        except BaseException as error:  # re-raised below; the others stop at the barrier
            errors.append(error)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


# -- the layout -------------------------------------------------------------------------------
def test_all_to_all_hands_each_rank_the_whole_sequence_for_its_heads():
    """[B, H, S/n, Dh] shards → rank r holds heads r·H/n .. of every token, and back."""
    whole = torch.randn(2, 4, 8, 3)  # [B, H, S, Dh]

    def work(parallel: SequenceParallel, rank: int) -> tuple[Tensor, Tensor, Tensor]:
        shard = parallel.split(whole, 2)
        heads = parallel.heads_to_sequence(shard)
        return shard, heads, parallel.sequence_to_heads(heads)

    for rank, (shard, heads, back) in enumerate(on_threads(2, work)):
        torch.testing.assert_close(shard, whole[:, :, 4 * rank : 4 * rank + 4], rtol=0, atol=0)
        torch.testing.assert_close(heads, whole[:, 2 * rank : 2 * rank + 2], rtol=0, atol=0)
        torch.testing.assert_close(back, shard, rtol=0, atol=0)


# -- the DiT ----------------------------------------------------------------------------------
def perturbed(config: DiTConfig) -> DiT:
    """A DiT whose zero-initialised layers are not zero (every path carries gradient)."""
    torch.manual_seed(0)
    network = DiT(config)
    with torch.no_grad():
        for parameter in network.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return network


IMAGES = [(2, 8, 8), (1, 8, 16), (3, 16, 8)]  # (count, h, w): 16, 32 and 32 tokens each
CLIPS = [(2, 3, 8, 8), (1, 5, 4, 8), (1, 1, 8, 8)]  # (count, frames, h, w); a clip of 1 frame


def inputs(config: DiTConfig, shapes: list[tuple[int, ...]]) -> tuple[list[Tensor], ...]:
    generator = torch.Generator().manual_seed(1)
    channels = config.in_channels
    groups = [torch.randn(n, channels, *shape, generator=generator) for n, *shape in shapes]
    total = sum(shape[0] for shape in shapes)
    times = torch.rand(total, generator=generator) * 1000
    text = torch.randn(total, 7, config.text_dim, generator=generator)
    pooled = torch.randn(total, config.pooled_dim, generator=generator)
    weights = [torch.randn(group.shape, generator=generator) for group in groups]
    return groups, times, text, pooled, weights


def predict(network: DiT, data: tuple, packed: bool, kernel: str) -> tuple[list[Tensor], dict]:
    """The network's predictions and the gradients of a fixed weighted sum of them."""
    groups, times, text, pooled, weights = data
    if packed:
        outputs = network(groups, times, text, pooled, capacity=256, kernel=kernel)
    else:
        outputs = [network(groups[0], times, text, pooled)]
    sum(((out * weight).sum() for out, weight in zip(outputs, weights, strict=True))).backward()
    grads = {name: param.grad for name, param in network.named_parameters()}
    return [out.detach() for out in outputs], grads


ALTERNATING = {"attention": "alternating", "block": "adaln"}
CASES = {
    "full-pack": ({"block": "cross"}, IMAGES, True, "grouped", 2, "ulysses"),
    "full-pack-sdpa-4": ({"block": "llama"}, IMAGES, True, "sdpa", 4, "ulysses"),
    "st-dit-clips": ({"attention": "spatiotemporal"}, CLIPS, True, "grouped", 2, "ulysses"),
    "alternating-clips": (ALTERNATING, CLIPS, True, "sdpa", 2, "ulysses"),
    "dense-clips": ({"attention": "spatiotemporal"}, [(2, 3, 4, 8)], False, "auto", 2, "ulysses"),
    "dense-odd": ({"block": "cross"}, [(2, 6, 6)], False, "grouped", 2, "ulysses"),  # a pack
    # ring mode: full attention (document mask) ringed, the rest all-to-all
    "ring-full-pack": ({"block": "cross"}, IMAGES, True, "grouped", 2, "ring"),
    "ring-full-pack-4": ({"block": "llama"}, IMAGES, True, "sdpa", 4, "ring"),
    "ring-full-clips": ({"block": "adaln"}, CLIPS, True, "grouped", 4, "ring"),
    "ring-st-dit-clips": ({"attention": "spatiotemporal"}, CLIPS, True, "grouped", 2, "ring"),
    "ring-dense": ({"block": "cross"}, [(2, 8, 8)], False, "auto", 4, "ring"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_split_dit_predicts_and_trains_like_one_process(case, monkeypatch):
    """Each rank's prediction is the whole one; the mean of the ranks' gradients is one
    process's (FSDP averages over the data x cp ranks). Ring mode rings the full blocks
    only (an ST-DiT has none: all-to-all throughout)."""
    options, shapes, packed, kernel, size, mode = CASES[case]
    ringed = []
    ring = sequence_parallel.ring_self_attention
    monkeypatch.setattr(sequence_parallel, "ring_self_attention",
                        lambda *args: ringed.append(args) or ring(*args))  # fmt: skip
    network = perturbed(DiTConfig(**options))
    data = inputs(network.config, shapes)
    want, want_grads = predict(network, data, packed, kernel)

    def work(parallel: SequenceParallel, rank: int) -> tuple[list[Tensor], dict]:
        replica = copy.deepcopy(network)
        replica.zero_grad(set_to_none=True)
        replica.sequence_parallel, replica.token_multiple = parallel, size
        return predict(replica, data, packed, kernel)

    results = on_threads(size, work, mode)
    for outputs, _ in results:
        torch.testing.assert_close(outputs, want, rtol=1e-5, atol=1e-5)
    for name, want_grad in want_grads.items():
        mean = torch.stack([grads[name] for _, grads in results]).mean(0)
        torch.testing.assert_close(mean, want_grad, rtol=1e-4, atol=1e-5, msg=name)
    full = mode == "ring" and "full" in network.config.layouts
    assert len(ringed) == (size if full else 0)  # once per forward and rank


def test_cp_refuses_what_it_cannot_split(tmp_path):
    """One-line errors: heads that cp (x tp) does not divide, a pack that does not split, a
    strategy other than fsdp/hsdp, a family without a plan; data shares count cp groups."""
    raw = raw_config(tmp_path, tmp_path / "out", "fsdp", cp=2)
    backbone = build_backbone(build_config(raw))
    plan = backbone.context_parallel_plan()
    with pytest.raises(ValueError, match=r"^parallel.cp 3 does not divide the model's 4 atte"):
        check_context_plan(plan, "dit", 3)
    with pytest.raises(ValueError, match=r"divide the 1 attention heads of each parallel.tp"):
        check_context_plan(plan, "dit", 2, tp=4)
    with pytest.raises(ValueError, match="the sdxl family has no context-parallel plan"):
        check_context_plan(None, "sdxl", 2)
    check_plan(backbone.tensor_parallel_plan(), "dit", 2)  # tp 2 x cp 2: 1 head each
    check_context_plan(plan, "dit", 2, tp=2)
    with pytest.raises(ValueError, match=r"parallel.cp 2 splits .* not ddp; set parallel.str"):
        build_config(raw | {"parallel": {"strategy": "ddp", "cp": 2}})
    with pytest.raises(ValueError, match=r"parallel.cp 2 splits .* not none"):
        build_config(raw | {"parallel": {"strategy": "none", "cp": 2}})
    with pytest.raises(ValueError, match=r"make it a multiple of parallel.cp$"):
        build_config(raw | {"parallel": {"strategy": "fsdp", "cp": 3}})
    with pytest.raises(ValueError, match=r"split into parallel.tp x parallel.cp 12 equal"):
        build_config(raw | {"parallel": {"strategy": "fsdp", "cp": 3, "tp": 4}})
    from impasto.train.checks import model_problems

    sdxl = build_config(raw | {"model": {"family": "sdxl", "preset": "tiny"}})
    assert any("the sdxl family has no context-parallel plan" in line
               for line in model_problems(sdxl))  # fmt: skip
    group = RunGroup(rank=5, world=8, tp=2, cp=2)
    assert (group.data_rank, group.data_world, group.model_ranks) == (1, 2, 4)


# -- training on ranks (torchrun, gloo) --------------------------------------------------------
SIZES = [(64, 64), (48, 80), (80, 48)]  # 16 and 15 tokens per image: packs of mixed shapes
SAMPLE = {"every_steps": 3, "prompts": ["a red circle"], "num_steps": 2, "resolution": 48}
CHECKPOINTED = {"gradient_checkpointing": "all"}  # recomputes the exchanges in backward
RING = {"cp_mode": "ring"}


def raw_config(images: Path, out: Path, strategy: str, cp: int = 1, steps: int = 3,
               **sections: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    raw = {
        "model": {"family": "dit", "preset": "tiny"},
        "objective": {"prediction_type": "flow", "timestep_sampling": "logit_normal"},
        "data": {
            "path": str(images),
            "resolution": 64,
            "buckets": "generated",
            "bucket_step": 16,
            "bucket_min_side": 48,
            "bucket_max_side": 80,
            "pack_tokens": 128,
        },
        "optim": {"lr": 1e-3, "weight_decay": 0.01},
        "train": {
            "output_dir": str(out),
            "seed": 7,
            "max_steps": steps,
            "mixed_precision": "fp32",
        },
        "checkpoint": {"every_steps": 3, "keep_last": 2},
        "ema": {"enabled": True, "decay": 0.8},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
        "parallel": {"strategy": strategy, "cp": cp},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


def video_sections(clips: Path, vae: Path) -> dict[str, dict[str, Any]]:
    """An ST-DiT on clips of 17 and 9 frames (5 and 3 latent frames of 2 x 2 tokens) through a
    tiny random Wan VAE, packed 4 clips to 128 tokens; ``hsdp``: a 3-D mesh
    (replicate 1, shard 1, cp 2)."""
    return {
        "model": {
            "family": "dit",
            "preset": "tiny",
            "vae": str(vae),
            "dit": {"autoencoder": "video", "attention": "spatiotemporal", "text_length": 16},
        },
        "data": {
            "path": str(clips),
            "resolution": 32,
            "video": {"num_frames": 17},
            "buckets": "none",
        },
        "cache": {"latents": "memory", "text_embeddings": "memory"},
        "parallel": {"shard_size": 2},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """``cp2`` (fsdp), ``cp2-ring`` (fsdp, ring attention over the pack's documents) and
    ``cp2-video`` (hsdp, activation checkpointing; ring mode, which for an ST-DiT is the
    all-to-all hybrid): 2 ranks, one context-parallel group; on 4 ranks, ``mesh``: 2 data
    shares x cp 2 (fsdp over the flattened shard x cp dimension) and ``tp2-cp2``: one share,
    tp 2 inside a ring of cp 2 (one head per rank); ``resume``: ``cp2``'s run continued from
    its step 3 at cp 1 to step 5;
    ``one-*``: the one-process references (``one-accum``: 2 packs per step, as 2 data shares
    take)."""
    pytest.importorskip("av")
    from test_video_vae import tiny_wan_vae

    from impasto.data.demo import write_demo_dataset
    from impasto.data.demo_video import write_demo_video_dataset

    tmp = tmp_path_factory.mktemp("context-parallel")
    images, clips, vae = tmp / "images", tmp / "clips", tmp / "wan"
    write_demo_dataset(images, 24, 64, seed=1, sizes=SIZES)
    write_demo_video_dataset(clips, num_clips=4, seed=0, variants=[(32, 17), (32, 9)])
    tiny_wan_vae(0).save_pretrained(vae, safe_serialization=True)
    out = tmp / "runs"

    def config(name, strategy, cp=1, steps=3, video=False, **sections):
        if video:
            sections = video_sections(clips, vae) | sections
        return raw_config(images, out / name, strategy, cp, steps, **sections)

    launch_plan(tmp, [
        (config("cp2", "fsdp", 2, sample=SAMPLE), False),
        (config("cp2-ring", "fsdp", 2, parallel=RING), False),
        (config("cp2-video", "hsdp", 2, video=True, memory=CHECKPOINTED, parallel=RING), False),
    ])  # fmt: skip
    launch_plan(tmp, [
        (config("mesh", "fsdp", 2), False),
        (config("tp2-cp2", "fsdp", 2, parallel={"tp": 2, **RING}), False),
    ], nproc=4)  # fmt: skip
    shutil.copytree(out / "cp2", out / "resume")
    in_process(
        (config("one", "none", sample=SAMPLE), False),
        (config("one-accum", "none", train={"grad_accum_steps": 2}), False),
        (config("one-video", "none", video=True), False),
        (config("one-5", "none", steps=5, sample=SAMPLE), False),
        (config("resume", "fsdp", steps=5, sample=SAMPLE), True),
    )
    return out


@pytest.mark.slow
@pytest.mark.parametrize("run", ["cp2", "cp2-ring", "cp2-video"])
def test_two_way_context_parallel_trains_like_one_process(runs, run):
    """Losses, gradient norms, weights and EMA after 3 steps equal one process's (float
    tolerance; Adam would hide a gradient off by a constant factor, the norm does not)."""
    reference = runs / run.replace("cp2", "one").replace("-ring", "")
    assert_same_training(runs / run, reference)
    assert_same_training(runs / run, reference, ema=True)
    torch.testing.assert_close(grad_norms(runs / run), grad_norms(reference), rtol=1e-4, atol=0)


def grad_norms(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["grad_norm"] for line in lines]


@pytest.mark.slow
@pytest.mark.parametrize("run,reference", [("mesh", "one-accum"), ("tp2-cp2", "one")])
def test_context_parallel_composes_with_fsdp_and_tp(runs, run, reference):
    """4 ranks: 2 data shares x cp 2 = one process accumulating 2 packs; tp 2 x cp 2 = one
    process."""
    assert_same_training(runs / run, runs / reference)
    got, want = grad_norms(runs / run), grad_norms(runs / reference)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=0)


@pytest.mark.slow
def test_validation_samples_match_one_process(runs):
    """A 48x48 sample (9 tokens: a pack of 128 split in 2) is the one process's image."""
    pairs = list(zip(sorted((runs / "cp2" / "samples").glob("*.png")),
                     sorted((runs / "one" / "samples").glob("*.png")), strict=True))  # fmt: skip
    assert pairs
    for a, b in pairs:
        image_a, image_b = (np.asarray(Image.open(path), np.int16)[40:] for path in (a, b))
        assert np.abs(image_a - image_b).max() <= 1  # below the titles (the run's name)


@pytest.mark.slow
def test_cp2_checkpoint_resumes_at_cp1(runs):
    """Step 3 written by a cp 2 group (DCP shards over the flattened shard x cp dimension),
    resumed by one process at cp 1: the continued run equals an uninterrupted 5-step run."""
    checkpoints = sorted((runs / "resume" / "checkpoints").iterdir())
    assert [path.name for path in checkpoints] == ["step-00000003", "step-00000005"]
    assert all(is_sharded(path) for path in checkpoints)
    assert len(list(checkpoints[0].glob("__*_0.distcp"))) == 2  # written by 2 ranks
    assert len(losses(runs / "resume")) == 5
    assert_same_training(runs / "resume", runs / "one-5")
