"""Tensor parallelism (``parallel.tp``, issue #31) on CPU with gloo: a DiT split over 2 ranks
trains what one process trains, on a 2 x 2 mesh (FSDP over 2 data shares x TP 2) too, and a
checkpoint written at tp 2 resumes at tp 1.

The packed runs mix three bucket shapes (15 and 16 tokens per image) in 128-token packs; the
dense run's images are 64 x 64 (16 tokens: each rank holds 8). Validation samples at 48 x 48
(9 tokens, which do not split in 2) go through a pack. Every launch sets OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dist_helpers import assert_same_training, in_process, launch_plan, losses
from PIL import Image

from impasto.checkpoint.sharded import is_sharded
from impasto.config import build_config
from impasto.data.demo import write_demo_dataset
from impasto.distributed import RunGroup
from impasto.models import build_backbone
from impasto.train.tensor_parallel import check_plan

pytestmark = pytest.mark.slow  # ~2 minutes of torchrun launches

SIZES = [(64, 64), (48, 80), (80, 48)]


def raw_config(images: Path, out: Path, strategy: str, tp: int = 1, steps: int = 3,
               accum: int = 1, **sections: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
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
        },  # fmt: skip
        "optim": {"lr": 1e-3, "weight_decay": 0.01},
        "train": {
            "output_dir": str(out),
            "seed": 7,
            "max_steps": steps,
            "grad_accum_steps": accum,
            "mixed_precision": "fp32",
        },  # fmt: skip
        "checkpoint": {"every_steps": 3, "keep_last": 2},
        "ema": {"enabled": True, "decay": 0.8},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
        "parallel": {"strategy": strategy, "tp": tp},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


# Dense 64x64 batches of a llama-block DiT (RMSNorm with weights on the sequence's slices,
# SwiGLU, QK LayerNorm on the heads' slices).
LLAMA = {
    "model": {"family": "dit", "preset": "tiny", "dit": {"block": "llama", "qk_norm": "layer"}},
    "data": {"buckets": "none", "pack_tokens": None, "batch_size": 2},
}
CHECKPOINTED = {"gradient_checkpointing": "all"}  # applied after the split (torchtitan's order)
SAMPLE = {"every_steps": 3, "prompts": ["a red circle"], "num_steps": 2, "resolution": 48}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """``tp2`` / ``tp2-llama``: 2 ranks, one tensor-parallel group (``tp2-llama``: hsdp, so a
    3-D mesh of replicate x shard x tp, with activation checkpointing of every block);
    ``mesh``: 4 ranks, 2 data shares (fsdp) x tp 2; ``resume``: ``tp2``'s run, continued from
    its step 3 at tp 1 in one process to step 5; ``one-*``: the one-process references
    (``one-accum``: 2 packs per step, as 2 data shares take)."""
    tmp = tmp_path_factory.mktemp("tensor-parallel")
    data = tmp / "data"
    write_demo_dataset(data, 48, 64, seed=1, sizes=SIZES)
    out = tmp / "runs"

    def config(name, strategy, tp=1, steps=3, accum=1, **sections):
        return raw_config(data, out / name, strategy, tp, steps, accum, **sections)

    hsdp = {"shard_size": 2}  # (1 replica, 1 shard, 2 tp)
    launch_plan(tmp, [
        (config("tp2", "fsdp", 2, sample=SAMPLE), False),
        (config("tp2-llama", "hsdp", 2, memory=CHECKPOINTED, parallel=hsdp, **LLAMA), False),
    ])  # fmt: skip
    launch_plan(tmp, [(config("mesh", "fsdp", 2), False)], nproc=4)
    shutil.copytree(out / "tp2", out / "resume")
    in_process(
        (config("one", "none", sample=SAMPLE), False),
        (config("one-llama", "none", **LLAMA), False),
        (config("one-accum", "none", accum=2), False),
        (config("one-5", "none", steps=5, sample=SAMPLE), False),
        (config("resume", "fsdp", steps=5, sample=SAMPLE), True),
    )
    return out


@pytest.mark.parametrize("run", ["tp2", "tp2-llama"])
def test_two_way_tensor_parallel_trains_like_one_process(runs, run):
    """Losses, weights and EMA after 3 steps equal one process's (float tolerance)."""
    reference = runs / run.replace("tp2", "one")
    assert_same_training(runs / run, reference)
    assert_same_training(runs / run, reference, ema=True)


def test_validation_samples_match_one_process(runs):
    """A 48x48 sample (9 tokens, run as a pack split in 2) is the one process's image."""
    got = (runs / "tp2" / "samples").glob("*.png")
    want = (runs / "one" / "samples").glob("*.png")
    pairs = list(zip(sorted(got), sorted(want), strict=True))
    assert pairs
    for a, b in pairs:
        image_a, image_b = (np.asarray(Image.open(path), np.int16)[40:] for path in (a, b))
        difference = np.abs(image_a - image_b)  # below the titles (the run's name)
        assert difference.max() <= 1  # rounding of float-equal pixels


def test_fsdp_by_tensor_parallel_mesh_trains_like_one_process(runs):
    """4 ranks as 2 data shares (fsdp shards the split weights over them) x tp 2: one pack per
    share and step = one process accumulating 2 packs."""
    assert_same_training(runs / "mesh", runs / "one-accum")


def test_tp2_checkpoint_resumes_at_tp1(runs):
    """Step 3 written by a tp 2 group (DCP shards of the split weights), resumed by one
    process at tp 1: the continued run equals an uninterrupted 5-step run."""
    checkpoints = sorted((runs / "resume" / "checkpoints").iterdir())
    assert [path.name for path in checkpoints] == ["step-00000003", "step-00000005"]
    assert all(is_sharded(path) for path in checkpoints)
    assert len(list(checkpoints[0].glob("__*_0.distcp"))) == 2  # written by 2 ranks
    assert len(losses(runs / "resume")) == 5
    assert_same_training(runs / "resume", runs / "one-5")


def test_tp_refuses_what_it_cannot_split(tmp_path):
    """One-line errors: a family without a plan, a tp that does not divide the heads, a pack
    that does not split, a strategy other than fsdp/hsdp."""
    raw = raw_config(tmp_path, tmp_path / "out", "fsdp", 2)
    config = build_config(raw)
    backbone = build_backbone(config)
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        check_plan(backbone.tensor_parallel_plan(), "dit", 8)
    with pytest.raises(ValueError, match="has no tensor-parallel plan"):
        check_plan(None, "sdxl", 2)
    with pytest.raises(ValueError, match="set parallel.strategy: fsdp"):
        build_config(raw | {"parallel": {"strategy": "ddp", "tp": 2}})
    with pytest.raises(ValueError, match="make it a multiple of parallel.tp"):
        build_config(raw | {"parallel": {"strategy": "fsdp", "tp": 3}})
    assert RunGroup(rank=5, world=8, tp=2).data_rank == 2
    assert RunGroup(rank=5, world=8, tp=2).data_world == 4
