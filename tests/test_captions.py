"""Caption tools (issue #6): tag shuffle with keep-first-N, tag dropout, prefix/suffix, and
tag-frequency loss weights carried per sample into the batch."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from impasto.config import build_config
from impasto.data import build_dataloader, scan_image_folder
from impasto.data.captions import CaptionTools, split_tags, tag_frequency_weights
from impasto.train.trainer import Trainer

CAPTION = "sks, 1girl, red hair, smiling, outdoors, night"


def test_all_tools_off_returns_the_caption_and_draws_nothing():
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    assert CaptionTools().apply(CAPTION, generator) == CAPTION
    assert torch.equal(generator.get_state(), state)


def test_shuffle_keeps_the_first_tags_and_permutes_the_rest():
    tools = CaptionTools(shuffle=True, keep_tags=1)
    results = {tools.apply(CAPTION, torch.Generator().manual_seed(seed)) for seed in range(30)}
    for result in results:
        tags = split_tags(result)
        assert tags[0] == "sks" and sorted(tags) == sorted(split_tags(CAPTION))
    assert len(results) > 10  # 5! = 120 orders of the unkept tags
    again = tools.apply(CAPTION, torch.Generator().manual_seed(3))
    assert again == tools.apply(CAPTION, torch.Generator().manual_seed(3))  # reproducible


def test_tag_dropout_rate_and_kept_tags():
    tools = CaptionTools(keep_tags=2, tag_dropout=0.3, prefix="photo of ", suffix=", best")
    draws, dropped = 2000, 0
    for seed in range(draws):
        result = tools.apply(CAPTION, torch.Generator().manual_seed(seed))
        assert result.startswith("photo of sks, 1girl") and result.endswith(", best")
        dropped += 4 - (len(split_tags(result[len("photo of ") : -len(", best")])) - 2)
    rate, expected = dropped / (4 * draws), 0.3
    assert abs(rate - expected) < 5 * math.sqrt(expected * (1 - expected) / (4 * draws))


def test_tag_frequency_weights_by_hand():
    # counts: a 3, b 1, c 1. Scores mean(1/count): (1/3 + 1)/2, (1/3 + 1)/2, 1/3; mean 5/9.
    weights = tag_frequency_weights(["a, b", "a, c", "a", ""], 0.5, 2.0)
    assert weights == pytest.approx([1.2, 1.2, 0.6, 1.0])
    clamped = tag_frequency_weights(["a, b", "a, c", "a"], 0.7, 1.1)
    assert clamped == pytest.approx([1.1, 1.1, 0.7])
    with pytest.raises(ValueError, match="tag_weight_min"):
        tag_frequency_weights(["a"], 1.5, 2.0)


def test_the_loader_applies_tools_and_weights_per_sample(demo_folder):
    records = scan_image_folder(demo_folder)
    weights = [0.5 + i / 10 for i in range(len(records))]
    tools = CaptionTools(prefix="demo, ")
    loader, _ = build_dataloader(
        records, 64, "center", False, 4, seed=0, caption_tools=tools, loss_weights=weights
    )
    batch = next(iter(loader))
    for caption, index, weight in zip(
        batch.captions, batch.indices.tolist(), batch.loss_weights.tolist(), strict=True
    ):
        assert caption == "demo, " + records[index].caption
        assert weight == pytest.approx(weights[index])
    plain, _ = build_dataloader(records, 64, "center", False, 4, seed=0)
    assert next(iter(plain)).loss_weights is None


def test_the_trainer_weights_samples_by_tag_frequency(tiny_raw, demo_folder, tmp_path):
    folder = tmp_path / "tagged"
    folder.mkdir()
    captions = ["sks, a, b", "sks, a, c", "sks, a", "sks, a, b"]
    images = sorted(demo_folder.glob("*.png"))[:4]
    for i, (image, caption) in enumerate(zip(images, captions, strict=True)):
        shutil.copyfile(image, folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(caption)
    tiny_raw["data"].update(path=str(folder), tag_frequency_weighting=True, shuffle_tags=True)
    tiny_raw["data"]["keep_tags"] = 1
    trainer = Trainer(build_config(tiny_raw), resume=False)
    # counts sks 4, a 4, b 2, c 1; scores mean(1/count) 1/3, 1/2, 1/4, 1/3; mean 17/48.
    expected = [48 / 17 * score for score in (1 / 3, 1 / 2, 1 / 4, 1 / 3)]
    batch = next(trainer.data.stream)
    assert batch.loss_weights.tolist() == pytest.approx([expected[i] for i in batch.indices])
    assert all(caption.startswith("sks, ") for caption in batch.captions)
