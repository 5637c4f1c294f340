"""``impasto data preview`` (issue #17): the sheet shows exactly what the training step
receives: the same crops (compared as tensors, then as the sheet's pixels) and captions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFont

from impasto.config import build_config
from impasto.data.preview import (
    CELL_MIN_WIDTH,
    draw_sheet,
    preview_examples,
    preview_sheet,
    wrap_text,
)
from impasto.train.trainer import Trainer

CAPTIONS = ["cat, red, circle, white background", "cat, blue, square", "dog, green", "dog"]
SIZES = [(64, 64), (48, 80), (80, 48), (64, 64)]  # (height, width): three buckets


@pytest.fixture(scope="module")
def pets(demo_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``3_cat`` and ``1_dog`` with tag captions, at three aspect ratios."""
    root = tmp_path_factory.mktemp("preview")
    images = sorted(demo_folder.glob("*.png"))
    for folder, start in (("3_cat", 0), ("1_dog", 4)):
        (root / folder).mkdir()
        for number in range(4):
            image = images[start + number]
            height, width = SIZES[number]
            with Image.open(image) as opened:
                opened.resize((width, height)).save(root / folder / image.name)
            caption = CAPTIONS[(start // 2 + number) % len(CAPTIONS)]
            (root / folder / f"{image.stem}.txt").write_text(caption, encoding="utf-8")
    return root


def pets_raw(pets: Path, run_dir: Path) -> dict:
    """Every augmentation on: buckets, random crop, flip, tag shuffle and dropout, caption
    dropout, a prefix; two micro-batches a step."""
    return {
        "model": {"preset": "tiny"},
        "data": {
            "path": str(pets), "resolution": 64, "batch_size": 2, "buckets": "generated",
            "bucket_step": 16, "crop": "random", "random_flip": True, "shuffle_tags": True,
            "keep_tags": 1, "tag_dropout": 0.3, "caption_dropout": 0.2, "caption_prefix": "sks, ",
        },
        "optim": {"lr": 1e-3, "weight_decay": 0.0},
        "train": {"output_dir": str(run_dir), "seed": 3, "max_steps": 3, "grad_accum_steps": 2},
        "checkpoint": {"every_steps": 100, "save_final": False},
        "log": {"every_steps": 3, "jsonl": False, "tensorboard": False, "progress_bar": False},
    }  # fmt: skip


def trained_batches(raw: dict) -> list:
    """Every micro-batch the training step received, as a run consumes them."""
    trainer = Trainer(build_config(raw), resume=False)
    received = []
    micro_step = trainer.setup.micro_step

    def recording(batch, *args, **kwargs):
        received.append(batch)
        return micro_step(batch, *args, **kwargs)

    trainer.setup.micro_step = recording
    trainer.run()
    return received


def quantised(pixels: torch.Tensor, factor: int) -> np.ndarray:
    """``[3, H, W]`` in [-1, 1] as the uint8 pixels of a crop enlarged ``factor`` times."""
    values = ((pixels + 1) / 2 * 255).round().clamp(0, 255).to(torch.uint8)
    array = values.permute(1, 2, 0).numpy()
    return np.repeat(np.repeat(array, factor, axis=0), factor, axis=1)


def test_the_sheets_crops_equal_what_the_training_step_receives(pets, tmp_path) -> None:
    raw = pets_raw(pets, tmp_path / "run")
    batches = trained_batches(raw)
    assert len(batches) == 6  # 3 steps x 2 micro-batches
    pixels = [row for batch in batches for row in batch.pixel_values]
    captions = [caption for batch in batches for caption in batch.captions]
    sizes = [tuple(size.tolist()) for batch in batches for size in batch.target_sizes]
    assert len(set(sizes)) == 3 and "" in captions  # buckets and caption dropout took part

    config = build_config(pets_raw(pets, tmp_path / "elsewhere"))
    examples = preview_examples(config, len(pixels))
    assert not (tmp_path / "elsewhere").exists()  # a preview writes nothing into the run
    assert [example.caption for example in examples] == captions
    assert [example.size for example in examples] == sizes
    for example, row in zip(examples, pixels, strict=True):
        assert torch.equal(example.pixels, row)

    path = preview_sheet(config, tmp_path / "sheet.png", num=len(pixels))
    sheet = np.asarray(Image.open(path).convert("RGB"))
    boxes = draw_sheet(examples).boxes
    for example, (left, top, right, bottom) in zip(examples, boxes, strict=True):
        factor = (right - left) // example.size[1]
        assert right - left >= CELL_MIN_WIDTH and factor * example.size[1] == right - left
        assert np.array_equal(sheet[top:bottom, left:right], quantised(example.pixels, factor))


def test_a_cached_runs_preview_shows_its_crops_and_its_captions(pets, tmp_path) -> None:
    """With latents and text on disk the step gets encodings; the preview decodes the same
    crops (their posterior is the cached one) and shows the cached caption variants."""
    raw = pets_raw(pets, tmp_path / "run")
    raw["data"] |= {"crop": "center", "caption_dropout": 0.0}
    raw["train"] |= {"max_steps": 2}
    raw["cache"] = {"latents": "disk", "text_embeddings": "disk", "dtype": "float32",
                    "caption_variants": 2, "dir": str(tmp_path / "cache")}  # fmt: skip
    trainer = Trainer(build_config(raw), resume=False)
    received = []
    micro_step = trainer.setup.micro_step
    trainer.setup.micro_step = lambda batch, *a, **k: (
        received.append(batch) or micro_step(batch, *a, **k)
    )
    trainer.run()
    backbone = trainer.setup.backbone
    assert all(batch.pixel_values is None for batch in received)  # the run decoded no image
    examples = preview_examples(build_config(raw), 8)
    assert [e.caption for e in examples] == [c for batch in received for c in batch.captions]
    uncached = dict(raw, cache={})
    for example, plain in zip(examples, preview_examples(build_config(uncached), 8), strict=True):
        assert torch.equal(example.pixels, plain.pixels)  # the crops do not depend on the cache
    means = [row for batch in received for row in batch.latent_mean]
    with torch.no_grad():
        encoded = [backbone.latent_posterior(e.pixels[None])[0][0] for e in examples]
    for mean, own in zip(means, encoded, strict=True):
        torch.testing.assert_close(mean.float(), own.float(), rtol=1e-4, atol=1e-4)


def test_preview_errors(pets, tmp_path) -> None:
    config = build_config(pets_raw(pets, tmp_path / "run"))
    with pytest.raises(ValueError, match="at least 1"):
        preview_examples(config, 0)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n", encoding="utf-8")
    raw = pets_raw(pets, tmp_path / "run")
    raw["data"] = {"prompts": str(prompts), "batch_size": 1}
    with pytest.raises(ValueError, match="nothing to preview"):
        preview_examples(build_config(raw), 4)
    # More than the run trains on: the whole run (3 steps x 2 micro-batches x 2 images).
    assert len(preview_examples(config, 100)) == 12


def test_labels_wrap_to_the_cell() -> None:
    font = ImageFont.load_default(size=15)
    lines = wrap_text("a " * 40 + "x" * 200, font, 120)
    assert all(font.getlength(line) <= 120 for line in lines)
    assert "".join(lines).replace(" ", "") == "a" * 40 + "x" * 200
