"""Pipeline parallelism (``parallel.pp``, issue #32) on CPU with gloo: a DiT split into 2 stages
trains what one process trains (1F1B over 128-token packs; GPipe over dense batches), alone and
with each stage's blocks split by tensor parallelism (4 ranks: pp 2 x tp 2, fsdp over each
stage's tp groups), checkpoints written at pp 2 and at pp 2 x tp 2 resume at pp 1, and a
pipelined step logs its stage's FLOPs. Without processes: the stages run in a row predict
what the whole network predicts, their parameters are the network's under the same names, and
the config refuses what pp does not compose with.

The pipelined runs accumulate 2 micro-batches per step (the pipeline's micro-batches); their
one-process references accumulate the same 2. Every launch sets OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import assert_same_training, in_process, launch_plan, losses, trained_weights

from impasto.checkpoint.sharded import is_sharded
from impasto.config import build_config
from impasto.data.demo import write_demo_dataset
from impasto.distributed import RunGroup
from impasto.models import build_backbone
from impasto.models.dit.network import DiT, DiTConfig
from impasto.models.dit.pipeline import SHARED, DiTStage, stage_blocks
from impasto.models.parts import Part
from impasto.train.checks import config_problems
from impasto.train.pipeline_parallel import split_pipeline

# The tests share one worker (pytest-xdist), which sets the launches' fixture up once.
pytestmark = pytest.mark.xdist_group("test_pipeline_parallel")

SIZES = [(64, 64), (48, 80), (80, 48)]


def raw_config(images: Path, out: Path, strategy: str, pp: int = 1, steps: int = 3,
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
        },  # fmt: skip
        "optim": {"lr": 1e-3, "weight_decay": 0.01, "max_grad_norm": 1.0},
        "train": {
            "output_dir": str(out),
            "seed": 7,
            "max_steps": steps,
            "grad_accum_steps": 2,
            "mixed_precision": "fp32",
        },  # fmt: skip
        "checkpoint": {"every_steps": 3, "keep_last": 2},
        "ema": {"enabled": True, "decay": 0.8},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
        "parallel": {"strategy": strategy, "pp": pp},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


# Dense 64x64 batches (every micro-batch one shape) of a llama-block DiT, run by GPipe.
DENSE = {
    "model": {"family": "dit", "preset": "tiny", "dit": {"block": "llama"}},
    "data": {"buckets": "none", "pack_tokens": None, "batch_size": 2},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """``pp2``: 2 ranks, 2 stages of 3 blocks each (fsdp over each stage's one rank), 1F1B;
    ``pp2-dense``: the same with GPipe over dense batches; ``resume``: ``pp2``'s run continued
    from its step 3 at pp 1 in one process to step 5; ``one-*``: the one-process references
    (``one-5``: 5 steps, its step-3 checkpoint the reference of ``pp2``)."""
    tmp = tmp_path_factory.mktemp("pipeline-parallel")
    data = tmp / "data"
    write_demo_dataset(data, 48, 64, seed=1, sizes=SIZES)
    out = tmp / "runs"

    def config(name, strategy, pp=1, steps=3, **sections):
        return raw_config(data, out / name, strategy, pp, steps, **sections)

    gpipe = {"strategy": "fsdp", "pp": 2, "pp_schedule": "gpipe"}
    launch_plan(tmp, [
        (config("pp2", "fsdp", 2), False),
        (config("pp2-dense", "fsdp", 2, steps=2, parallel=gpipe, **DENSE), False),
    ])  # fmt: skip
    launch_plan(tmp, [
        (config("pptp", "fsdp", 2, parallel={"tp": 2}), False),
        (config("pptp-dense", "fsdp", 2, steps=2, parallel=gpipe | {"tp": 2},
                memory={"gradient_checkpointing": "all"}, **DENSE), False),
    ], nproc=4)  # fmt: skip
    shutil.copytree(out / "pp2", out / "resume")
    shutil.copytree(out / "pptp", out / "resume-pptp")
    in_process(
        (config("one-5", "none", steps=5), False),
        (config("one-dense", "none", steps=2, **DENSE), False),
        (config("resume", "fsdp", steps=5), True),
        (config("resume-pptp", "fsdp", steps=5), True),
    )
    return out


@pytest.mark.slow  # the fixture's torchrun launches and one-process runs: ~3 minutes
@pytest.mark.distributed
@pytest.mark.parametrize("run", ["pp2", "pptp"])
def test_two_stages_train_like_one_process(runs, run):
    """Losses of 3 steps, weights and EMA after them equal one process's (float tolerance):
    2 stages, and 2 stages each split over a tp group of 2 (``pptp``: the hidden states
    travel whole between the stages' groups)."""
    step3 = runs / "one-5" / "checkpoints" / "step-00000003"
    torch.testing.assert_close(losses(runs / run), losses(runs / "one-5")[:3], rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    for ema in (False, True):
        got, want = trained_weights(runs / run, ema), trained_weights(step3, ema)
        assert got.keys() == want.keys()
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


@pytest.mark.slow  # the fixture's torchrun launches and one-process runs: ~3 minutes
@pytest.mark.distributed
@pytest.mark.parametrize("run", ["pp2-dense", "pptp-dense"])
def test_gpipe_over_dense_batches_trains_like_one_process(runs, run):
    """GPipe over dense batches of a llama-block DiT (``pptp-dense``: with tp 2, and every
    block's activations recomputed in backward, its stage's gather of the slices too)."""
    assert_same_training(runs / run, runs / "one-dense")
    assert_same_training(runs / run, runs / "one-dense", ema=True)


@pytest.mark.slow  # the fixture's torchrun launches and one-process runs: ~3 minutes
@pytest.mark.distributed
@pytest.mark.parametrize(("run", "ranks"), [("resume", 2), ("resume-pptp", 4)])
def test_pipelined_checkpoint_resumes_at_pp1(runs, run, ranks):
    """Step 3 written by 2 stages (each its share of the weights, under the whole model's
    names; ``resume-pptp``: each stage's split over tp 2 too), resumed by one process at
    pp 1 (and tp 1): the continued run equals an uninterrupted one."""
    checkpoints = sorted((runs / run / "checkpoints").iterdir())
    assert [path.name for path in checkpoints] == ["step-00000003", "step-00000005"]
    assert all(is_sharded(path) for path in checkpoints)
    assert len(list(checkpoints[0].glob("__*_0.distcp"))) == ranks  # one file per writer
    assert len(losses(runs / run)) == 5
    assert_same_training(runs / run, runs / "one-5")


def step_flops(run: Path) -> list[float]:
    """Each logged step's FLOPs on rank 0 (its TFLOP/s × its step time)."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [row["tflops"] * 1e12 * row["step_time"] for row in map(json.loads, lines)]


@pytest.mark.slow  # the fixture's torchrun launches and one-process runs: ~3 minutes
@pytest.mark.distributed
def test_pipelined_steps_log_their_stage_flops(runs):
    """Rank 0 (stage 0: the batch's encoding, the embedders and 3 of the 6 blocks) logs the
    FLOPs it ran, counted as a one-process step is: more than half the whole step's (the
    encoding runs on every stage), less than all of it, alike for steps of alike shapes."""
    whole, stage = step_flops(runs / "one-5")[:3], step_flops(runs / "pp2")
    assert len(stage) == 3
    for got, want in zip(stage, whole, strict=True):
        assert want / 2 < got < want * 0.9
    assert stage[0] == pytest.approx(stage[1], rel=1e-6)  # two steps of 2 packs of 128 tokens


# -- without processes ---------------------------------------------------------------------
def test_stage_blocks_cover_the_network_in_order():
    assert [list(stage_blocks(6, s, 2)) for s in range(2)] == [[0, 1, 2], [3, 4, 5]]
    assert [len(stage_blocks(30, s, 4)) for s in range(4)] == [8, 8, 7, 7]  # the seed's 28B
    assert [list(stage_blocks(5, s, 3)) for s in range(3)] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="set parallel.pp to at most 6"):
        stage_blocks(6, 0, 7)


@pytest.mark.parametrize("packed", [False, True])
def test_stages_in_a_row_predict_what_the_network_does(packed):
    """Stage 0 → 1 → 2 on one call (each stage preparing it alike) is the whole forward, and
    the stages' parameters are the network's, under its names (the embedders on each)."""
    torch.manual_seed(0)
    config = DiTConfig(size="tiny", block="cross")
    network = DiT(config)
    with torch.no_grad():
        for parameter in network.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)  # zero-initialised layers too
    generator = torch.Generator().manual_seed(1)
    shapes = [(2, 8, 8), (1, 8, 16)] if packed else [(2, 8, 8)]
    groups = [torch.randn(n, config.in_channels, h, w, generator=generator) for n, h, w in shapes]
    total = sum(n for n, _, _ in shapes)
    times = torch.rand(total, generator=generator) * 1000
    text = torch.randn(total, 7, config.text_dim, generator=generator)
    pooled = torch.randn(total, config.pooled_dim, generator=generator)
    x = groups if packed else groups[0]
    want = network(x, times, text, pooled)
    names = dict(network.named_parameters())
    stages = [DiTStage(network, stage, 3) for stage in range(3)]
    call = stages[0].prepare(x, times, text, pooled)
    hidden = call.tokens
    for stage in stages:
        source, output = stage.io_meta(stage.prepare(x, times, text, pooled))
        assert source.shape == hidden.shape
        hidden = stage(hidden, stage.prepare(x, times, text, pooled))
        assert output.shape == hidden.shape
    got = call.finish(hidden)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    held = [dict(stage.named_parameters()) for stage in stages]
    assert set().union(*held) == set(names)
    for stage_params in held:
        for name, param in stage_params.items():
            assert param is names[name]
    shared = [name for name in held[1] if name.startswith(SHARED)]
    assert shared and all(name in held[0] and name in held[2] for name in shared)
    assert not set(held[0]) - set(shared) & set(held[1])  # blocks: on one stage each


def test_pp_refuses_what_it_does_not_compose_with(tmp_path):
    """One-line errors naming the option and the fix."""
    raw = raw_config(tmp_path, tmp_path / "out", "fsdp", 2)
    assert build_config(raw).parallel.pp == 2
    both = build_config(raw | {"parallel": {"strategy": "hsdp", "pp": 2, "tp": 2}}).parallel
    assert (both.pp, both.tp) == (2, 2)  # composes: each stage's blocks split over tp
    refused = {
        "set parallel.strategy: fsdp": {"parallel": {"strategy": "ddp", "pp": 2}},
        "parallel.cp; set parallel.cp: 1": {"parallel": {"strategy": "fsdp", "pp": 2, "cp": 2}},
        "set train.grad_accum_steps to at least 4": {
            "parallel": {"strategy": "fsdp", "pp": 4}
        },
        "sample.every_steps; sampling runs the whole": {
            "sample": {"every_steps": 2, "prompts": ["a"]}
        },
    }  # fmt: skip
    for message, change in refused.items():
        with pytest.raises(ValueError, match=message):
            build_config(raw | change)
    unet = build_config(raw | {"model": {"family": "sdxl", "preset": "tiny"}})
    assert any("family cannot split" in line for line in config_problems(unet))
    backbone = build_backbone(build_config(raw))
    text = {"text_encoder": Part("text_encoder", backbone.parts()["text_encoder"], "full", 1e-4)}
    with pytest.raises(ValueError, match="set parts.text_encoder: frozen"):
        split_pipeline(backbone, text, RunGroup(pp=2))


def test_run_group_places_stages_outermost():
    """8 ranks as pp 2 × (2 data shares × tp 2): a stage is 4 consecutive ranks; rank 5 is
    stage 1's second rank of data share 0."""
    group = RunGroup(rank=5, world=8, pp=2, tp=2)
    assert (group.stage_world, group.data_rank, group.data_world) == (4, 0, 2)
    assert RunGroup(rank=6, world=8, pp=2, tp=2).data_rank == 1
    assert RunGroup(rank=3, world=4, pp=2).data_rank == 1
