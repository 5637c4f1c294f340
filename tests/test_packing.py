"""Packs of mixed-shape images (``data.pack_tokens``, issue #31): the first-fit-decreasing plan,
collation into shape groups, the packed loss (= the mean of each image's loss alone), and a
packed DiT run that resumes bitwise."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from impasto.config import build_config
from impasto.data import Example, collate_examples
from impasto.data.packing import first_fit_decreasing, pack_layout, plan_packs
from impasto.data.sampler import ResumableBatchSampler
from impasto.models import build_backbone
from impasto.objectives.objective import Objective
from impasto.train.methods.denoise import packed_denoising_loss
from impasto.train.trainer import train

SIZES = {(64, 64): 16, (48, 96): 18, (96, 48): 18}  # (h, w) → tokens of the tiny DiT (p = 2)


def test_first_fit_decreasing_fills_the_first_pack_with_room():
    assert first_fit_decreasing([18, 18, 16, 16, 16, 4], 40) == [[0, 1, 5], [2, 3], [4]]
    with pytest.raises(ValueError, match="does not fit a pack of 32"):
        first_fit_decreasing([40], 32)


def test_every_epoch_packs_every_image_once_in_the_same_layout():
    tokens_of = [16] * 40 + [18] * 30 + [None] * 3 + [18] * 27  # None: in no bucket
    layout = pack_layout(tokens_of, 128)
    assert layout.num_packs == 14 and layout.utilisation == pytest.approx(1666 / (14 * 128))
    plans = [plan_packs(tokens_of, 128, seed=5, epoch=epoch) for epoch in range(3)]
    for plan in plans:
        assert len(plan) == layout.num_packs
        placed = sorted(index for pack in plan for index in pack)
        assert placed == [i for i, t in enumerate(tokens_of) if t is not None]
        assert all(sum(tokens_of[i] for i in pack) <= 128 for pack in plan)
        # the same multiset of pack fillings every epoch, other images in them
        fills = sorted(sum(tokens_of[i] for i in pack) for pack in plan)
        assert fills == sorted(sum(tokens_of[i] for i in pack) for pack in plans[0])
    assert plans[0] != plans[1]
    assert plan_packs(tokens_of, 128, seed=5, epoch=1) == plans[1]  # a pure function


def test_a_packed_sampler_resumes_and_splits_across_ranks():
    tokens_of = [16] * 50 + [18] * 41
    one = ResumableBatchSampler(91, 4, seed=1, tokens_of=tokens_of, pack_tokens=128)
    epochs = [list(one.epoch_batches(e)) for e in range(2)]
    flat = [[key.index for key in batch] for epoch in epochs for batch in epoch]
    ranks = [
        ResumableBatchSampler(91, 4, seed=1, rank=r, world_size=2, tokens_of=tokens_of,
                              pack_tokens=128)
        for r in range(2)
    ]  # fmt: skip
    first_steps = [next(iter(sampler)) for sampler in ranks]
    assert [[key.index for key in batch] for batch in first_steps] == flat[:2]
    resumed = one.at(1, 3)
    assert [key.index for key in next(iter(resumed))] == flat[one.num_batches_per_epoch + 3]
    with pytest.raises(ValueError, match="pack_tokens"):
        ResumableBatchSampler(91, 4, seed=1, tokens_of=tokens_of, pack_tokens=256).load_state_dict(
            one.state_dict()
        )


def _example(index: int, size: tuple[int, int], caption: str) -> Example:
    pixels = torch.rand(3, *size, generator=torch.Generator().manual_seed(index)) * 2 - 1
    return Example(pixels, caption, size, (0, 0), index, target_size=size)


def test_a_pack_collates_into_one_group_per_shape():
    examples = [_example(0, (64, 64), "a"), _example(1, (48, 96), "b"), _example(2, (64, 64), "c")]
    batch = collate_examples(examples)
    assert batch.pixel_values is None and batch.size == 3
    assert [group.captions for group in batch.groups] == [["a", "c"], ["b"]]
    assert batch.captions == ["a", "c", "b"] and batch.indices.tolist() == [0, 2, 1]
    assert batch.target_sizes.tolist() == [[64, 64], [64, 64], [48, 96]]
    assert batch.groups[1].pixel_values.shape == (1, 3, 48, 96)


def test_a_packed_loss_is_the_mean_of_each_images_loss_alone(tiny_raw):
    raw = copy.deepcopy(tiny_raw)
    raw["model"] = {"family": "dit", "preset": "tiny"}
    raw["objective"] = {
        "prediction_type": "flow", "timestep_sampling": "logit_normal", "flow_shift": 2.0,
        "flow_shift_resolution": 64,  # each shape's times shifted by its own size
    }  # fmt: skip
    raw["data"]["pack_tokens"] = 128
    config = build_config(raw)
    backbone = build_backbone(config)
    with torch.no_grad():  # a trained-looking network: the zero init predicts 0 everywhere
        for parameter in backbone.denoiser().parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    objective = Objective.from_config(config.objective)
    sizes = [(64, 64), (48, 96), (64, 64), (96, 48), (48, 96)]
    examples = [_example(i, size, f"a red circle {i}") for i, size in enumerate(sizes)]
    pack = collate_examples(examples)

    def loss(batch, generator):
        return packed_denoising_loss(
            backbone, objective, batch, generator,
            lambda: torch.autocast("cpu", enabled=False), 128,
        )  # fmt: skip

    packed = loss(pack, torch.Generator().manual_seed(3))
    alone = packed_denoising_loss(
        OneByOne(backbone), objective, pack, torch.Generator().manual_seed(3),
        lambda: torch.autocast("cpu", enabled=False), 128,
    )  # fmt: skip
    assert packed.timesteps.unique().numel() == 5  # every image its own time
    torch.testing.assert_close(packed.timesteps, alone.timesteps, rtol=0, atol=0)
    torch.testing.assert_close(packed.per_sample_loss, alone.per_sample_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed.loss, alone.per_sample_loss.mean(), rtol=1e-5, atol=1e-6)
    assert alone.per_sample_loss.std() > 0.01  # the images' losses differ


class OneByOne:
    """The same backbone, each image of a pack through a forward of its own."""

    def __init__(self, backbone) -> None:
        self.backbone = backbone

    def __getattr__(self, name: str):
        return getattr(self.backbone, name)

    def forward_packed(self, x_ts, timesteps, conditions, capacity=None):
        outputs = []
        for x_t, times, condition in zip(x_ts, timesteps, conditions, strict=True):
            rows = []
            for i in range(x_t.shape[0]):
                one = type(condition)(*(getattr(condition, f.name)[i : i + 1]
                                        for f in dataclasses.fields(condition)))  # fmt: skip
                rows.append(self.backbone.forward(x_t[i : i + 1], times[i : i + 1], one))
            outputs.append(torch.cat(rows))
        return outputs


def _mixed_folder(root: Path) -> Path:
    """Demo-style images in three shapes, each with its caption."""
    from impasto.data import demo_caption, demo_spec, render_demo_image

    root.mkdir(parents=True, exist_ok=True)
    shapes = [(64, 64), (96, 48), (48, 96)]
    for index in range(24):
        spec = demo_spec(index, 0, 64)
        image = render_demo_image(spec, 64)
        height, width = shapes[index % 3]
        image.resize((width, height), Image.NEAREST).save(root / f"{index:03d}.png")
        (root / f"{index:03d}.txt").write_text(
            demo_caption(spec.color, spec.shape, spec.background)
        )
    return root


def test_a_packed_dit_run_mixes_buckets_and_resumes_bitwise(tmp_path, tiny_raw):
    raw = copy.deepcopy(tiny_raw)
    raw["model"] = {"family": "dit", "preset": "tiny"}
    raw["objective"] = {"prediction_type": "flow"}
    raw["data"] = {
        "path": str(_mixed_folder(tmp_path / "mixed")), "resolution": 64, "buckets": "generated",
        "bucket_step": 16, "bucket_min_side": 48, "bucket_max_side": 96, "pack_tokens": 128,
    }  # fmt: skip
    raw["train"]["max_steps"] = 6
    raw["checkpoint"] = {"every_steps": 3, "keep_last": 3}
    whole = train(build_config(raw))
    stopped = copy.deepcopy(raw)
    stopped["train"]["output_dir"] = str(tmp_path / "stopped")
    stopped["train"]["max_steps"] = 3
    train(build_config(stopped))
    stopped["train"]["max_steps"] = 6
    resumed = train(build_config(stopped))
    a = load_file(whole.last_checkpoint / "transformer.safetensors")
    b = load_file(resumed.last_checkpoint / "transformer.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_dit_demo_fills_its_packs_to_97_percent():
    from impasto.config import load_config

    config = load_config(Path(__file__).parents[1] / "configs" / "demo-dit.yaml")
    data = config.data
    backbone = build_backbone(config)
    sizes = [data.demo_sizes[i % len(data.demo_sizes)] for i in range(data.demo_num_images)]
    tokens_of = [backbone.sequence_length(*size) for size in sizes]
    assert sorted(set(tokens_of)) == [15, 16]  # 48x80 and 80x48: 15 tokens; 64x64: 16
    layout = pack_layout(tokens_of, data.pack_tokens)
    assert layout.utilisation >= 0.97, layout
