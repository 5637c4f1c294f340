"""Tests for impasto.data: demo dataset, folder scan, transforms, sampler, dataset, loader."""

from __future__ import annotations

import itertools
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from impasto.data import (
    DEMO_BACKGROUNDS,
    DEMO_COLORS,
    DEMO_SHAPES,
    BatchPosition,
    ImageCaptionDataset,
    ImageRecord,
    ResumableBatchSampler,
    Skipped,
    build_dataloader,
    collate_examples,
    demo_caption,
    demo_spec,
    derive_seed,
    render_demo_image,
    resize_and_crop,
    scan_image_folder,
    write_demo_dataset,
)

CAPTION_PATTERN = re.compile(r"^an? (\w+) (\w+) on a (\w+) background$")


def parse_caption(caption: str) -> tuple[str, str, str]:
    match = CAPTION_PATTERN.match(caption)
    assert match is not None, caption
    return match.group(1), match.group(2), match.group(3)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- seeding -------------------------------------------------------------------------------


def test_derive_seed_is_stable_and_spread() -> None:
    # Pinned values: changing the hash would silently change every run's data order.
    assert derive_seed(0) == 1046475002784276470
    assert derive_seed(0, 1) == 1299276118717988966
    assert derive_seed(np.int64(0), 1) == derive_seed(0, 1)
    seeds = {derive_seed(7, epoch, index) for epoch in range(4) for index in range(50)}
    assert len(seeds) == 200
    assert all(0 <= seed < 2**63 for seed in seeds)
    assert derive_seed(1, 23) != derive_seed(12, 3)


@pytest.mark.parametrize("bad", [1.5, True, "3"])
def test_derive_seed_rejects_non_integers(bad: object) -> None:
    with pytest.raises(ValueError, match="pass integers"):
        derive_seed(0, bad)  # type: ignore[arg-type]


# --- demo ----------------------------------------------------------------------------------


def test_demo_is_deterministic(tmp_path: Path) -> None:
    assert write_demo_dataset(tmp_path / "a", num_images=8, size=32, seed=3) == 8
    write_demo_dataset(tmp_path / "b", num_images=8, size=32, seed=3)
    write_demo_dataset(tmp_path / "c", num_images=8, size=32, seed=4)
    names = sorted(path.name for path in (tmp_path / "a").iterdir())
    assert names[:2] == ["img-00000.png", "img-00000.txt"]
    assert len(names) == 16
    same = [(tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes() for n in names]
    other = [(tmp_path / "a" / n).read_bytes() == (tmp_path / "c" / n).read_bytes() for n in names]
    assert all(same)
    assert not all(other)


def test_demo_prefix_does_not_depend_on_num_images(tmp_path: Path) -> None:
    write_demo_dataset(tmp_path / "short", num_images=3, size=32, seed=1)
    write_demo_dataset(tmp_path / "long", num_images=30, size=32, seed=1)
    for name in ("img-00000.png", "img-00002.png", "img-00002.txt"):
        assert (tmp_path / "short" / name).read_bytes() == (tmp_path / "long" / name).read_bytes()


def test_demo_images_show_their_caption(tmp_path: Path) -> None:
    write_demo_dataset(tmp_path, num_images=24, size=48, seed=0)
    for index in range(24):
        stem = tmp_path / f"img-{index:05d}"
        color, shape, background = parse_caption(stem.with_suffix(".txt").read_text().strip())
        assert color in DEMO_COLORS and shape in DEMO_SHAPES and background in DEMO_BACKGROUNDS
        pixels = np.array(Image.open(stem.with_suffix(".png")))
        assert pixels.shape == (48, 48, 3)
        foreground = np.all(pixels == DEMO_COLORS[color], axis=-1)
        background_mask = np.all(pixels == DEMO_BACKGROUNDS[background], axis=-1)
        # Only two colours (no anti-aliasing), and the shape is clearly visible.
        assert np.all(foreground | background_mask)
        assert 0.3**2 * 0.45 <= foreground.mean() <= 0.72**2
        rows, cols = np.nonzero(foreground)
        centroid = int(round(rows.mean())), int(round(cols.mean()))
        assert tuple(pixels[centroid]) == DEMO_COLORS[color]
        # The shape lies fully inside the image and spans its bounding box vertically.
        left, top, side = demo_spec(index, seed=0, size=48).box
        assert left >= 0 and top >= 0 and left + side <= 48 and top + side <= 48
        assert rows.min() == top and rows.max() == top + side - 1


def test_demo_shape_geometry() -> None:
    # The square fills its box, the circle about pi/4 of it, the triangle about half.
    fills = {}
    for index in range(21):
        spec = demo_spec(index, seed=5, size=64)
        pixels = np.array(render_demo_image(spec, 64))
        left, top, side = spec.box
        inside = pixels[top : top + side, left : left + side]
        fills[spec.shape] = np.all(inside == DEMO_COLORS[spec.color], axis=-1).mean()
    assert fills["square"] == 1.0
    assert abs(fills["circle"] - np.pi / 4) < 0.06
    assert abs(fills["triangle"] - 0.5) < 0.08


def test_demo_covers_all_combinations(tmp_path: Path) -> None:
    write_demo_dataset(tmp_path, num_images=36, size=16, seed=11)
    triples = [parse_caption(p.read_text().strip()) for p in sorted(tmp_path.glob("*.txt"))]
    assert {(c, s) for c, s, _ in triples} == set(itertools.product(DEMO_COLORS, DEMO_SHAPES))
    assert {b for _, _, b in triples} == set(DEMO_BACKGROUNDS)
    num_triples = len(DEMO_COLORS) * len(DEMO_SHAPES) * len(DEMO_BACKGROUNDS)
    captions = [demo_spec(i, seed=11, size=16).caption for i in range(num_triples)]
    assert len(set(captions)) == num_triples
    assert captions[0] == demo_caption(*triples[0])


def test_demo_colours_are_distinct() -> None:
    assert len(DEMO_COLORS) >= 6 and {"circle", "square", "triangle"} <= set(DEMO_SHAPES)
    colours = np.array(list(DEMO_COLORS.values()) + list(DEMO_BACKGROUNDS.values()), dtype=float)
    distances = np.linalg.norm(colours[:, None] - colours[None], axis=-1)
    assert distances[~np.eye(len(colours), dtype=bool)].min() > 80
    assert demo_caption("red", "circle", "white") == "a red circle on a white background"


def test_demo_refuses_non_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="already exists") as error:
        write_demo_dataset(tmp_path, num_images=2)
    assert "\n" not in str(error.value) and str(tmp_path) in str(error.value)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# --- folder --------------------------------------------------------------------------------


def save_image(path: Path, color: tuple[int, int, int] = (10, 20, 30), size=(8, 6)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGB", size, color)
    image.save(path, format={"jpg": "JPEG"}.get(path.suffix[1:].lower(), None))
    return path


def test_scan_sorts_and_reads_captions(tmp_path: Path) -> None:
    save_image(tmp_path / "b.png")
    save_image(tmp_path / "a" / "z.JPG")
    save_image(tmp_path / "a" / "c.webp")
    save_image(tmp_path / "a-b.bmp")
    save_image(tmp_path / ".cache" / "hidden.png")
    (tmp_path / "b.txt").write_text("  a cat\n", encoding="utf-8")
    (tmp_path / "a" / "z.txt").write_text("\ufeffun café", encoding="utf-8")
    (tmp_path / "readme.md").write_text("not an image")
    records = scan_image_folder(tmp_path)
    relative = [r.image_path.relative_to(tmp_path).as_posix() for r in records]
    assert relative == ["a/c.webp", "a/z.JPG", "a-b.bmp", "b.png"]
    assert [r.caption for r in records] == ["", "un café", "", "a cat"]
    assert records[3] == ImageRecord(tmp_path / "b.png", "a cat")


def test_scan_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="does not exist") as error:
        scan_image_folder(missing)
    assert str(missing) in str(error.value) and "\n" not in str(error.value)
    (tmp_path / "only.txt").write_text("x")
    with pytest.raises(ValueError, match="no images found") as error:
        scan_image_folder(tmp_path)
    assert str(tmp_path) in str(error.value) and ".png" in str(error.value)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="not a folder"):
        scan_image_folder(tmp_path / "only.txt")


# --- transforms ----------------------------------------------------------------------------


def test_center_crop_of_landscape_image() -> None:
    image = Image.new("RGB", (200, 100), (255, 255, 255))  # PIL sizes are (width, height)
    pixels, original_size, crop_top_left = resize_and_crop(image, 64, "center", False, generator(0))
    assert original_size == (100, 200)
    assert crop_top_left == (0, 32)
    assert pixels.shape == (3, 64, 64) and pixels.dtype == torch.float32
    torch.testing.assert_close(pixels, torch.ones(3, 64, 64))


def test_center_crop_of_portrait_image_and_value_range() -> None:
    # Black and white 10 x 10 blocks: the downscale keeps pure black and white in block centres.
    blocks = np.random.default_rng(0).integers(0, 2, (30, 10, 3), dtype=np.uint8) * 255
    noise = blocks.repeat(10, axis=0).repeat(10, axis=1)
    pixels, original_size, crop_top_left = resize_and_crop(
        Image.fromarray(noise), 64, "center", False, generator(0)
    )
    assert original_size == (300, 100)
    assert crop_top_left == (64, 0)  # resized to 192 x 64, (192 - 64) / 2 = 64
    assert pixels.min() >= -1.0 and pixels.max() <= 1.0
    assert pixels.min() < -0.9 and pixels.max() > 0.9


def test_random_crop_is_reproducible_and_in_bounds() -> None:
    image = Image.new("RGB", (300, 100))
    offsets = set()
    for seed in range(20):
        first = resize_and_crop(image, 50, "random", True, generator(seed))
        second = resize_and_crop(image, 50, "random", True, generator(seed))
        assert first[2] == second[2]
        torch.testing.assert_close(first[0], second[0], rtol=0, atol=0)
        top, left = first[2]
        assert top == 0 and 0 <= left <= 150 - 50
        offsets.add(left)
    assert len(offsets) > 5


def test_flip_moves_known_pattern() -> None:
    # 64 x 128 image: left half red, right half blue; no resize at R=64, centre crop x = 32..95.
    array = np.zeros((64, 128, 3), dtype=np.uint8)
    array[:, :64] = (255, 0, 0)
    array[:, 64:] = (0, 0, 255)
    image = Image.fromarray(array)
    red = torch.tensor([1.0, -1.0, -1.0])
    blue = torch.tensor([-1.0, -1.0, 1.0])
    outcomes = set()
    for seed in range(12):
        flipped = bool(torch.rand((), generator=generator(seed)) < 0.5)
        pixels, _, crop_top_left = resize_and_crop(image, 64, "center", True, generator(seed))
        assert crop_top_left == (0, 32)
        left, right = (blue, red) if flipped else (red, blue)
        torch.testing.assert_close(pixels[:, :, :32], left[:, None, None].expand(3, 64, 32))
        torch.testing.assert_close(pixels[:, :, 32:], right[:, None, None].expand(3, 64, 32))
        unflipped, _, _ = resize_and_crop(image, 64, "center", False, generator(seed))
        torch.testing.assert_close(unflipped[:, 0, 0], red)
        outcomes.add(flipped)
    assert outcomes == {True, False}


@pytest.mark.parametrize("mode", ["RGBA", "L", "P", "CMYK"])
def test_any_mode_becomes_rgb(mode: str) -> None:
    image = Image.new("RGB", (40, 30), (200, 100, 50)).convert(mode)
    pixels, original_size, _ = resize_and_crop(image, 16, "center", False, generator(0))
    assert pixels.shape == (3, 16, 16) and original_size == (30, 40)


def test_unknown_crop_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid crops are center, random"):
        resize_and_crop(Image.new("RGB", (8, 8)), 8, "middle", False, generator(0))


# --- sampler -------------------------------------------------------------------------------


def run_keys(sampler: ResumableBatchSampler, num_epochs: int) -> list[list[tuple[int, ...]]]:
    """The trainer's loop: iterate the rest of each epoch, advancing after every batch."""
    batches = []
    while sampler.position.epoch < num_epochs:
        for batch in sampler:
            batches.append([tuple(key) for key in batch])
            sampler.advance()
    return batches


def test_sampler_epochs_are_permutations_and_differ() -> None:
    sampler = ResumableBatchSampler(num_samples=10, batch_size=3, seed=1)
    assert sampler.num_batches_per_epoch == 3 and len(sampler) == 3
    batches = run_keys(sampler, num_epochs=3)
    assert len(batches) == 9 and all(len(batch) == 3 for batch in batches)
    orders = []
    for epoch in range(3):
        keys = [key for batch in batches[3 * epoch : 3 * epoch + 3] for key in batch]
        assert {key[0] for key in keys} == {epoch}
        assert [key[3] for key in keys] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        indices = [key[1] for key in keys]
        assert len(set(indices)) == 9 and set(indices) <= set(range(10))
        orders.append(indices)
    assert orders[0] != orders[1] != orders[2]
    assert sampler.position == BatchPosition(3, 0)


def test_sampler_resumes_exactly_at_every_position() -> None:
    full_sampler = ResumableBatchSampler(num_samples=11, batch_size=4, seed=7)
    full = run_keys(full_sampler, num_epochs=3)
    assert len(full) == 6
    sampler = ResumableBatchSampler(num_samples=11, batch_size=4, seed=7)
    states = [sampler.state_dict()]
    for _ in full:
        sampler.advance()
        states.append(sampler.state_dict())
    for consumed, state in enumerate(states):
        resumed = ResumableBatchSampler(num_samples=11, batch_size=4, seed=7)
        resumed.load_state_dict(state)
        assert run_keys(resumed, num_epochs=3) == full[consumed:]
        at = ResumableBatchSampler(11, 4, 7).at(state["epoch"], state["batch_in_epoch"])
        assert run_keys(at, num_epochs=3) == full[consumed:]


def test_sampler_position_ignores_prefetching() -> None:
    sampler = ResumableBatchSampler(num_samples=12, batch_size=3, seed=0)
    iterator = iter(sampler)
    prefetched = [next(iterator), next(iterator), next(iterator)]  # a loader running ahead
    assert sampler.position == BatchPosition(0, 0)
    assert sampler.advance() == BatchPosition(0, 1)
    assert [key.step_batch for key in prefetched[1]] == [1, 1, 1]
    assert [tuple(k) for k in next(iter(sampler))] == [tuple(k) for k in prefetched[1]]
    assert len(list(iterator)) == 1  # the old iterator still finishes its own epoch


def test_sampler_set_epoch_keeps_resumed_batch() -> None:
    sampler = ResumableBatchSampler(num_samples=12, batch_size=3, seed=0, start_position=(2, 3))
    sampler.set_epoch(2)
    assert sampler.position == BatchPosition(2, 3) and len(sampler) == 1
    sampler.set_epoch(3)
    assert sampler.position == BatchPosition(3, 0)
    sampler.seek(1, 4)  # end of epoch 1 is the start of epoch 2
    assert sampler.position == BatchPosition(2, 0)


def test_sampler_keep_last_and_no_shuffle() -> None:
    sampler = ResumableBatchSampler(7, 3, seed=0, shuffle=False, drop_last=False)
    batches = [[key.index for key in batch] for batch in sampler]
    assert batches == [[0, 1, 2], [3, 4, 5], [6]]


def test_sampler_fill_last_loses_no_image_and_resumes() -> None:
    sampler = ResumableBatchSampler(10, 4, seed=2, drop_last=False, fill_last=True)
    assert sampler.num_batches_per_epoch == 3
    batches = run_keys(sampler, num_epochs=2)
    for epoch in range(2):
        indices = [[key[1] for key in batch] for batch in batches[3 * epoch : 3 * epoch + 3]]
        assert [len(batch) for batch in indices] == [4, 4, 4]
        assert {i for batch in indices for i in batch} == set(range(10))  # nobody left out
        assert len(set(indices[2])) == 4  # the filled batch holds distinct images
        assert sorted(indices[0] + indices[1] + indices[2][:2]) == list(range(10))
    resumed = ResumableBatchSampler(10, 4, seed=2, drop_last=False, fill_last=True)
    resumed.load_state_dict(sampler.at(0, 2).state_dict())
    assert run_keys(resumed, num_epochs=2) == batches[2:]
    tiny = ResumableBatchSampler(3, 4, seed=0, drop_last=False, fill_last=True)
    assert sorted({key.index for key in next(iter(tiny))}) == [0, 1, 2]  # fewer than a batch


def test_sampler_errors() -> None:
    with pytest.raises(ValueError, match="data: 3 images is fewer than batch_size 4"):
        ResumableBatchSampler(num_samples=3, batch_size=4, seed=0)
    sampler = ResumableBatchSampler(num_samples=8, batch_size=2, seed=0)
    state = sampler.state_dict()
    with pytest.raises(ValueError, match="checkpoint has batch_size=2 but this run has 4"):
        ResumableBatchSampler(num_samples=8, batch_size=4, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="outside the run"):
        sampler.seek(0, 5)
    assert all(isinstance(value, int) for value in state.values())


# --- dataset and loader --------------------------------------------------------------------


def demo_records(root: Path, num_images: int = 8, size: int = 40) -> list[ImageRecord]:
    write_demo_dataset(root, num_images=num_images, size=size, seed=2)
    return scan_image_folder(root)


def test_dataset_example_is_deterministic(tmp_path: Path) -> None:
    records = demo_records(tmp_path)
    dataset = ImageCaptionDataset(records, resolution=32, crop="random", random_flip=True, seed=9)
    first, again, next_epoch = dataset[(0, 5)], dataset[(0, 5)], dataset[(1, 5)]
    assert first is not None and again is not None and next_epoch is not None
    torch.testing.assert_close(first.pixel_values, again.pixel_values, rtol=0, atol=0)
    assert first.caption == records[5].caption and first.index == 5
    assert first.original_size == (40, 40) and first.pixel_values.shape == (3, 32, 32)
    assert first.crop_top_left == (0, 0)  # square image: resized to exactly R
    # Another epoch draws another flip for at least one of the images.
    examples = [(dataset[(0, i)], dataset[(1, i)]) for i in range(8)]
    assert any(not torch.equal(a.pixel_values, b.pixel_values) for a, b in examples)  # type: ignore[union-attr]


def test_bad_files_are_skipped_with_name_and_reason(tmp_path: Path) -> None:
    records = demo_records(tmp_path / "demo", num_images=3)
    png_bytes = records[0].image_path.read_bytes()
    truncated_png = tmp_path / "truncated.png"
    truncated_png.write_bytes(png_bytes[: len(png_bytes) // 2])
    truncated_jpg = save_image(tmp_path / "photo.jpg", size=(64, 64))
    noisy = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noisy).save(truncated_jpg, format="JPEG")
    truncated_jpg.write_bytes(truncated_jpg.read_bytes()[:-300])
    fake_png = tmp_path / "fake.png"
    fake_png.write_text("this is a caption, not an image")
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    bad = [ImageRecord(path, "bad") for path in (truncated_png, truncated_jpg, fake_png, empty)]
    dataset = ImageCaptionDataset(records + bad, 32, "center", False, seed=0)
    assert [isinstance(dataset[(0, i)], Skipped) for i in range(7)] == [False] * 3 + [True] * 4
    assert dataset[(0, 6)].name == str(empty) and "unreadable image" in dataset[(0, 6)].reason
    batch = collate_examples([dataset[(0, i)] for i in (0, 3, 1, 4, 5)])
    assert batch.num_bad == 3 and batch.size == 2
    assert [item.name for item in batch.skipped] == [str(r.image_path) for r in bad[:3]]
    assert batch.captions == [records[0].caption, records[1].caption]
    assert batch.indices.tolist() == [0, 1]
    all_bad = collate_examples([dataset[(0, 3)], dataset[(0, 6)]])
    assert all_bad.size == 0 and all_bad.num_bad == 2 and all_bad.pixel_values is None


def test_batch_fields(tmp_path: Path) -> None:
    records = demo_records(tmp_path, num_images=4, size=48)
    dataset = ImageCaptionDataset(records, 32, "center", False, seed=0)
    batch = collate_examples([dataset[(0, 1, 0, 0)], dataset[(0, 2, 0, 0)]])
    assert batch is not None
    assert batch.pixel_values.shape == (2, 3, 32, 32)
    assert batch.original_sizes.tolist() == [[48, 48], [48, 48]]
    assert batch.crop_top_lefts.tolist() == [[0, 0], [0, 0]]
    assert batch.target_sizes.tolist() == [[32, 32], [32, 32]]
    assert batch.original_sizes.dtype == torch.long and batch.position == BatchPosition(0, 0)
    moved = batch.to("cpu")
    assert moved.captions == batch.captions and torch.equal(moved.pixel_values, batch.pixel_values)


def collect(loader, sampler, limit: int | None = None) -> list:
    """Run the trainer's loop over ``loader``; stop after ``limit`` batches."""
    seen = []
    while sampler.position.epoch < 2:
        for batch in loader:
            assert batch.position == sampler.position
            seen.append((batch.position, batch.indices.tolist(), batch.pixel_values))
            sampler.advance()
            if limit is not None and len(seen) == limit:
                return seen
    return seen


def test_loader_workers_match_and_resume(tmp_path: Path) -> None:
    records = demo_records(tmp_path, num_images=10, size=40)
    options = dict(resolution=32, crop="random", random_flip=True, batch_size=3, seed=4)
    loader, sampler = build_dataloader(records, **options, num_workers=0)
    single = collect(loader, sampler)
    # 10 images in batches of 3: the fourth batch is filled with two already-shown images.
    positions = [BatchPosition(e, b) for e in (0, 1) for b in (0, 1, 2, 3)]
    assert [p for p, _, _ in single] == positions
    loader, sampler = build_dataloader(records, **options, num_workers=2)
    parallel = collect(loader, sampler)
    assert len(parallel) == len(single) == 8
    for (p0, i0, x0), (p1, i1, x1) in zip(single, parallel, strict=True):
        assert p0 == p1 and i0 == i1
        torch.testing.assert_close(x0, x1, rtol=0, atol=0)
    # Stop after 5 batches (the loader has prefetched further), checkpoint, resume.
    loader, sampler = build_dataloader(records, **options, num_workers=2)
    collect(loader, sampler, limit=5)
    state = sampler.state_dict()
    assert (state["epoch"], state["batch_in_epoch"]) == (1, 1)
    loader, sampler = build_dataloader(records, **options, start_position=(1, 1))
    resumed = collect(loader, sampler)
    assert [(p, i) for p, i, _ in resumed] == [(p, i) for p, i, _ in single[5:]]
    for (_, _, x0), (_, _, x1) in zip(single[5:], resumed, strict=True):
        torch.testing.assert_close(x0, x1, rtol=0, atol=0)


def test_caption_dropout_rate_and_determinism(tmp_path: Path) -> None:
    write_demo_dataset(tmp_path / "d", num_images=8, size=16, seed=0)
    records = scan_image_folder(tmp_path / "d")
    plain = ImageCaptionDataset(records, 16, "random", True, seed=3)
    dropping = ImageCaptionDataset(records, 16, "random", True, seed=3, caption_dropout=0.5)
    keys = [(epoch, index) for epoch in range(50) for index in range(8)]
    dropped = [dropping[key].caption == "" for key in keys]
    assert 0.43 < sum(dropped) / len(dropped) < 0.57  # 400 draws: 3.5 standard deviations
    assert dropped == [dropping[key].caption == "" for key in keys]  # replays exactly
    for key in keys[:16]:  # the augmentation does not depend on the dropout setting
        assert torch.equal(plain[key].pixel_values, dropping[key].pixel_values)
    assert all(dropping[key].caption in ("", records[key[1]].caption) for key in keys)
    with pytest.raises(ValueError, match=r"data.caption_dropout: must be in \[0, 1\]"):
        ImageCaptionDataset(records, 16, "center", False, seed=0, caption_dropout=1.5)


def test_kohya_folder_names_give_repeats_unless_turned_off(demo_folder, tmp_path, capsys):
    from impasto.data.folder import scan_folder

    images = sorted(demo_folder.glob("*.png"))
    for folder, chosen in (("3_cats", images[:2]), ("dogs", images[2:3]), ("20231124_trip", [])):
        (tmp_path / folder).mkdir()
        for image in chosen:
            shutil.copyfile(image, tmp_path / folder / image.name)
            shutil.copyfile(image.with_suffix(".txt"), tmp_path / folder / f"{image.stem}.txt")
    names = [record.image_path.parent.name for record in scan_folder(tmp_path, None, True).records]
    assert names == ["3_cats"] * 6 + ["dogs"]  # each cat image three times, in a row
    assert "subfolder 3_cats: 3 repeats" in capsys.readouterr().out
    assert len(scan_folder(tmp_path, None, False).records) == 3  # data.folder_repeats: false
    assert len(scan_folder(tmp_path, {"3_cats": (2, 1.0)}, True).records) == 5  # config wins
    shutil.copyfile(images[3], tmp_path / "20231124_trip" / images[3].name)
    shutil.copyfile(
        images[3].with_suffix(".txt"), tmp_path / "20231124_trip" / f"{images[3].stem}.txt"
    )
    with pytest.raises(ValueError, match="'20231124_trip' reads as 20231124 repeats .* false"):
        scan_folder(tmp_path, None, True)
