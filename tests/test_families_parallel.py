"""The DiT tools on the released-DiT families (issue #33): packs (``data.pack_tokens``) train
flux, sd3 and wan (one forward per shape group: the packed loss is each image's, or each
clip's, loss alone), FSDP wraps their blocks (2 gloo ranks train as one process), and
``parallel.tp`` / ``cp`` / ``pp``, which these families have no plan for, stop with one line
saying so."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_helpers import assert_same_training, in_process, launch_plan
from test_packing import OneByOne, _example

from impasto.config import build_config
from impasto.data import Example, collate_examples
from impasto.data.demo import write_demo_dataset
from impasto.models import build_backbone
from impasto.objectives.objective import Objective
from impasto.train.checks import check_config
from impasto.train.methods.denoise import packed_denoising_loss

FAMILIES = ("flux", "sd3", "wan")
FLOW = {"prediction_type": "flow", "timestep_sampling": "logit_normal", "flow_shift": 3.0}


def _model(family: str) -> dict:
    return {"family": family, "preset": "tiny", family: {"text_length": 16}}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_loss_is_the_mean_of_each_images_loss_alone(family, tiny_raw):
    raw = copy.deepcopy(tiny_raw) | {"model": _model(family), "objective": FLOW}
    raw["parts"] = {"transformer": "lora"}
    raw["data"]["pack_tokens"] = 128  # the least allowed
    config = build_config(raw)
    check_config(config)
    backbone = build_backbone(config)
    objective = Objective.from_config(config.objective)
    sizes = [(64, 64), (48, 96), (64, 64), (96, 48), (48, 96)]
    pack = collate_examples([_example(i, size, f"a red circle {i}")
                             for i, size in enumerate(sizes)])  # fmt: skip

    def loss(model):
        return packed_denoising_loss(
            model, objective, pack, torch.Generator().manual_seed(3),
            lambda: torch.autocast("cpu", enabled=False), 128,
        )  # fmt: skip

    packed, alone = loss(backbone), loss(OneByOne(backbone))
    assert packed.timesteps.unique().numel() == 5  # every image its own time
    torch.testing.assert_close(packed.per_sample_loss, alone.per_sample_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed.loss, alone.per_sample_loss.mean(), rtol=1e-5, atol=1e-6)
    assert alone.per_sample_loss.std() > 0.01  # the images' losses differ


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("setting", "message"), [
    ({"tp": 2}, "parallel.tp 2: the {family} family has no tensor-parallel plan; set "
                "parallel.tp: 1 (fsdp shards its weights without it)"),
    ({"cp": 2}, "parallel.cp 2: the {family} family has no context-parallel plan (no split "
                "of its denoiser's sequence over ranks); set parallel.cp: 1"),
    ({"pp": 2}, "parallel.pp 2: the {family} family cannot split its denoiser into pipeline "
                "stages; set parallel.pp: 1 (fsdp shards its weights)"),
])  # fmt: skip
def test_tensor_context_and_pipeline_parallel_stop_with_one_line(family, setting, message,
                                                                tiny_raw):  # fmt: skip
    from impasto.config.load import ConfigError

    raw = copy.deepcopy(tiny_raw) | {"model": _model(family), "objective": FLOW}
    raw["parts"] = {"transformer": "lora"}
    raw["parallel"] = {"strategy": "fsdp", **setting}
    raw["train"]["grad_accum_steps"] = 2  # enough micro-batches for 2 pipeline stages
    with pytest.raises((ConfigError, ValueError)) as error:
        check_config(build_config(raw))
    text = str(error.value)
    assert message.format(family=family) in text
    assert len([line for line in text.splitlines() if "parallel." in line]) == 1


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_on_two_ranks_trains_each_family_like_one_process(tmp_path):
    """2 gloo ranks × batch 2 under FSDP (units: the family's blocks) against one process ×
    batch 4: the same losses and LoRA weights after 2 steps."""
    data = tmp_path / "data"
    write_demo_dataset(data, 8, 64, seed=1)

    def raw(family: str, name: str, strategy: str, batch: int) -> dict:
        return {
            "model": _model(family),
            "objective": FLOW,
            "parts": {"transformer": "lora"},
            "lora": {"rank": 4},
            "data": {"path": str(data), "resolution": 64, "batch_size": batch},
            "optim": {"lr": 1e-3, "weight_decay": 0.01},
            "train": {
                "output_dir": str(tmp_path / name),
                "seed": 7,
                "max_steps": 2,
                "mixed_precision": "fp32",
            },  # fmt: skip
            "checkpoint": {"every_steps": 2, "keep_last": 1},
            "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
            "parallel": {"strategy": strategy},
        }

    launch_plan(tmp_path, [(raw(f, f"fsdp-{f}", "fsdp", 2), False) for f in FAMILIES])
    in_process(*[(raw(f, f"one-{f}", "none", 4), False) for f in FAMILIES])
    for family in FAMILIES:
        assert_same_training(tmp_path / f"fsdp-{family}", tmp_path / f"one-{family}")


def _clip(index: int, frames: int, size: tuple[int, int], caption: str) -> Example:
    """A video run's sample: ``frames`` random frames ``[3, T, H, W]`` (1: an image)."""
    pixels = torch.rand(3, frames, *size, generator=torch.Generator().manual_seed(index)) * 2 - 1
    start = -1 if frames == 1 else 0
    return Example(pixels, caption, size, (0, 0), index, target_size=size, clip_start=start)


def test_a_packed_loss_of_wan_clips_is_the_mean_of_each_clips_loss_alone(tiny_raw):
    """Clips of different lengths and sizes (and an image) in one pack: one forward per
    shape group (diffusers' Wan transformer takes its 3-D RoPE from one tensor's shape, so
    shapes cannot share a sequence), each clip with its own time."""
    raw = copy.deepcopy(tiny_raw) | {"model": _model("wan"), "objective": FLOW}
    raw["parts"] = {"transformer": "lora"}
    raw["data"] |= {"pack_tokens": 128, "resolution": 32, "video": {"num_frames": 9}}
    config = build_config(raw)
    check_config(config)
    backbone = build_backbone(config)
    objective = Objective.from_config(config.objective)
    shapes = [(5, (32, 32)), (9, (32, 48)), (5, (32, 32)), (1, (48, 32)), (9, (32, 48))]
    pack = collate_examples([_clip(i, frames, size, f"a red circle {i}")
                             for i, (frames, size) in enumerate(shapes)])  # fmt: skip
    assert len(pack.groups) == 3

    def loss(model):
        return packed_denoising_loss(
            model, objective, pack, torch.Generator().manual_seed(3),
            lambda: torch.autocast("cpu", enabled=False), 128,
        )  # fmt: skip

    packed, alone = loss(backbone), loss(OneByOne(backbone))
    assert packed.timesteps.unique().numel() == 5  # every clip its own time
    torch.testing.assert_close(packed.per_sample_loss, alone.per_sample_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed.loss, alone.per_sample_loss.mean(), rtol=1e-5, atol=1e-6)
    assert alone.per_sample_loss.std() > 0.01
