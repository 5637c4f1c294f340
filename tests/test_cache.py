"""The on-disk cache: incremental, content-addressed, crash-safe, and equal to encoding on the
fly (latents, micro-conditioning, text), for one process and for two torchrun ranks."""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import rot_entry
from PIL import Image
from safetensors.torch import load_file, save_file

from impasto.cli import main
from impasto.config import build_config
from impasto.data import ImageCaptionDataset, Skipped, collate_examples, derive_seed
from impasto.data import cache_fill as disk_cache
from impasto.data.cache import ShardStore, ShardWriter, latent_key, text_key
from impasto.data.cache_fill import fill_cache, identify_images
from impasto.data.captions import caption_tools_from
from impasto.data.pipeline import DataStream, load_records, place_in_buckets
from impasto.data.skips import BadDataLog, text_embedding_name
from impasto.models import build_backbone, encode_prompts
from impasto.train.trainer import train

SIZES = [(64, 64), (48, 80), (80, 48), (64, 96), (70, 70)]


def write_folder(root: Path, count: int = 10) -> Path:
    """Images of several aspect ratios (not mirror-symmetric) with tag captions."""
    root.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    for i in range(count):
        height, width = SIZES[i % len(SIZES)]
        pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(root / f"{i:02d}.png")
        (root / f"{i:02d}.txt").write_text(f"photo {i}, tag{i % 3}, colour{i % 4}, shape{i % 2}")
    return root


def raw_config(tmp_path: Path, data: Path, **cache) -> dict:
    return {
        "model": {"preset": "tiny"},
        "data": {
            "path": str(data),
            "resolution": 64,
            "batch_size": 2,
            "buckets": "generated",
            "bucket_step": 16,
            "random_flip": True,
        },
        "cache": {"latents": "disk", "text_embeddings": "disk", "dtype": "float32", **cache},
        "optim": {"lr": 1e-3, "weight_decay": 0.0},
        "train": {"output_dir": str(tmp_path / "run"), "seed": 3, "max_steps": 4},
        "log": {"tensorboard": False, "progress_bar": False},
    }


def fill(raw: dict, models=None):
    config = build_config(raw)
    models = models or build_backbone(config)
    records, ids = identify_images(config, load_records(config))
    bucket_of = place_in_buckets(config, records, None)
    encodings, report = fill_cache(
        config, models, records, ids, bucket_of, contextlib.nullcontext, "None"
    )
    return config, models, records, bucket_of, encodings, report


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return write_folder(tmp_path / "images")


def test_second_fill_encodes_nothing_and_one_changed_image_only_it(tmp_path, folder) -> None:
    raw = raw_config(tmp_path, folder)
    _, models, _, _, _, first = fill(raw)
    assert (first.latents_encoded, first.latents_found) == (20, 0)  # 10 images, 2 flips each
    assert (first.texts_encoded, first.texts_found) == (10, 0)  # no random tools: 1 each
    _, _, _, _, _, second = fill(raw, models)
    assert (second.latents_encoded, second.latents_found) == (0, 20)
    assert (second.texts_encoded, second.texts_found) == (0, 10)

    Image.new("RGB", (80, 48), (1, 2, 3)).save(folder / "02.png")  # same size, new content
    _, _, _, _, _, third = fill(raw, models)
    assert (third.latents_encoded, third.latents_found) == (2, 18)
    assert third.texts_encoded == 0


def test_cached_latents_and_text_equal_on_the_fly(tmp_path, folder) -> None:
    raw = raw_config(tmp_path, folder, batch_size=3)
    raw["data"]["shuffle_tags"] = True
    raw["cache"]["caption_variants"] = 2
    config, models, records, bucket_of, encodings, _ = fill(raw)
    data = config.data
    settings = (64, "center", True, 3, 0.0, bucket_of, caption_tools_from(data))
    cached = ImageCaptionDataset(records, *settings, cache=encodings)
    plain = ImageCaptionDataset(records, *settings)
    plain.caption_variants = cached.caption_variants  # the same captions, for comparison
    flips = set()
    for epoch in range(3):
        for index in range(len(records)):
            from_cache, from_pixels = cached[(epoch, index)], plain[(epoch, index)]
            assert from_cache.pixel_values is None and from_cache.latent_mean is not None
            assert from_cache.original_size == from_pixels.original_size
            assert from_cache.crop_top_left == from_pixels.crop_top_left
            assert from_cache.target_size == tuple(from_pixels.pixel_values.shape[-2:])
            assert from_cache.caption == from_pixels.caption
            with torch.no_grad():
                posterior = models.components.vae.encode(from_pixels.pixel_values[None]).latent_dist
            torch.testing.assert_close(from_cache.latent_mean, posterior.mean[0])
            torch.testing.assert_close(from_cache.latent_std, posterior.std[0])
            with torch.no_grad():
                prompt = encode_prompts(models.components, [from_cache.caption])
            torch.testing.assert_close(from_cache.prompt_embeds, prompt.prompt_embeds[0])
            image_id = encodings.image_ids[index]
            generator = torch.Generator().manual_seed(derive_seed(3, epoch, index))
            size = (image_id.height, image_id.width)
            flips.add(cached.transform.params(*size, bucket_of[index], generator).flip)
    # epochs 0 and 2 use variant 0, epoch 1 variant 1 of the shuffled tags
    assert cached[(0, 4)].caption == cached[(2, 4)].caption != cached[(1, 4)].caption
    assert flips == {False, True}  # mirrored images (and crops) were among them


def test_truncated_shard_is_set_aside_and_rebuilt(tmp_path, folder) -> None:
    raw = raw_config(tmp_path, folder, shard_size_mb=1)
    raw["cache"]["text_embeddings"] = "none"
    _, models, records, _, encodings, _ = fill(raw)
    reference = {name: encodings.store.get(name).clone() for name in encodings.store.where}
    shard = encodings.store.shards[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _, _, _, _, rebuilt, report = fill(raw, models)
    assert report.damaged_shards == [shard.name] and report.latents_encoded == 20
    assert shard.with_suffix(".corrupt").exists() and not shard.exists()
    assert set(rebuilt.store.where) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(rebuilt.store.get(name), tensor), name


def test_a_crash_while_writing_leaves_no_shard(tmp_path, monkeypatch) -> None:
    writer = ShardWriter(tmp_path, "latents", rank=0, max_bytes=1 << 30)
    writer.add({"a.mean": torch.ones(4)})

    def crash(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a shard")
        raise OSError("disk full")

    monkeypatch.setattr("impasto.data.cache_shards.save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        writer.flush()
    assert not list((tmp_path / "shards").glob("*.safetensors"))
    assert ShardStore(tmp_path).where == {}
    monkeypatch.undo()
    ShardWriter(tmp_path, "latents", rank=0, max_bytes=1)  # a restarted rank 0 cleans up
    assert not list((tmp_path / "shards").iterdir())


def test_mismatched_entry_is_skipped_and_counted(tmp_path, folder, caplog) -> None:
    raw = raw_config(tmp_path, folder)
    raw["data"]["random_flip"] = False
    raw["cache"]["text_embeddings"] = "none"
    config, _, records, bucket_of, encodings, _ = fill(raw)
    params = ImageCaptionDataset(records, 64, "center", False, 3, bucket_of=bucket_of)
    image_id = encodings.image_ids[1]
    bucket = bucket_of[1]
    key = latent_key(
        image_id, params.transform.params(image_id.height, image_id.width, bucket, None),
        encodings.vae_fingerprint, "float32",
    )  # fmt: skip
    save_file(
        {f"{key}.mean": torch.zeros(4, 3, 3), f"{key}.std": torch.zeros(4, 3, 3)},
        str(encodings.store.folder / "zz-bad.safetensors"),
    )
    encodings.store.refresh()
    dataset = ImageCaptionDataset(records, 64, "center", False, 3, bucket_of=bucket_of,
                                  cache=encodings)  # fmt: skip
    skipped = dataset[(0, 1)]
    assert isinstance(skipped, Skipped) and skipped.name.endswith("01.png")
    assert "shape (4, 3, 3)" in skipped.reason and "01.png" in caplog.text
    batch = collate_examples([dataset[(0, 1)], dataset[(0, 6)]])
    assert batch.num_bad == 1 and batch.latent_mean.shape[0] == 1


def test_training_from_the_cache_matches_training_on_the_fly(tmp_path, folder) -> None:
    raw = raw_config(tmp_path / "cached", folder)
    on_the_fly = copy.deepcopy(raw)
    on_the_fly["cache"] = {"latents": "none", "text_embeddings": "none"}
    on_the_fly["train"]["output_dir"] = str(tmp_path / "plain" / "run")
    losses = []
    for settings in (raw, on_the_fly):
        run = train(build_config(settings)).run_dir
        lines = (run / "metrics.jsonl").read_text().splitlines()
        losses.append([json.loads(line)["loss"] for line in lines])
    assert len(losses[0]) == 4
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)


def test_cache_command_errors_and_config_checks(tmp_path, folder, capsys) -> None:
    raw = raw_config(tmp_path, folder)
    raw["cache"] = {"latents": "none"}
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(raw))
    assert main(["cache", str(path)]) == 2
    assert "set cache.latents and/or cache.text_embeddings to disk" in capsys.readouterr().err
    bad = raw_config(tmp_path, folder)
    bad["data"]["crop"] = "random"
    with pytest.raises(ValueError, match="set data.crop: center"):
        build_config(bad)
    bad = raw_config(tmp_path, folder)
    bad["parts"] = {"text_encoder": "lora"}
    with pytest.raises(ValueError, match="cache.text_embeddings: 'disk' reuses"):
        build_config(bad)


@pytest.mark.slow  # a torchrun launch (13 s)
@pytest.mark.distributed
def test_torchrun_two_ranks_split_the_fill(tmp_path, folder) -> None:
    raw = raw_config(tmp_path, folder)
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(raw))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "-m", "impasto", "cache", str(path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    shards = sorted(p.name for p in (folder / ".impasto-cache" / "shards").glob("*.safetensors"))
    assert {name.split("-")[0] + "-" + name.split("-")[2] for name in shards} == {
        "latents-r0", "latents-r1", "text-r0", "text-r1",
    }  # fmt: skip
    _, _, _, _, _, again = fill(raw)
    assert (again.latents_encoded, again.latents_found) == (0, 20)
    assert (again.texts_encoded, again.texts_found) == (0, 10)
    assert disk_cache.cache_dir(build_config(raw)) == folder / ".impasto-cache"


def test_a_cached_run_resumes_exactly(tmp_path, folder, capsys) -> None:
    raw = raw_config(tmp_path / "straight", folder, caption_variants=2)
    raw["data"].update(shuffle_tags=True, caption_dropout=0.2)
    raw["train"]["max_steps"] = 6
    raw["checkpoint"] = {"every_steps": 3}
    straight = train(build_config(raw)).run_dir
    resumed = copy.deepcopy(raw)
    resumed["train"].update(output_dir=str(tmp_path / "resumed" / "run"), max_steps=3)
    train(build_config(resumed))
    resumed["train"]["max_steps"] = 6
    capsys.readouterr()
    run = train(build_config(resumed)).run_dir
    assert "(step 3)" in capsys.readouterr().out  # it resumed, mid-epoch (5 batches per epoch)
    names = ("checkpoints", "step-00000006", "unet.safetensors")
    a, b = load_file(straight.joinpath(*names)), load_file(run.joinpath(*names))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_blob_record_changes_identity_with_its_shard(tmp_path) -> None:
    from impasto.data import ImageRecord
    from impasto.data.cache import _container_stat, record_identity
    from impasto.data.sources import FileRangeBlob

    shard = tmp_path / "s.tar"
    shard.write_bytes(b"x" * 100)
    record = ImageRecord("s.tar/0.png", "c", blob=FileRangeBlob(str(shard), 10, 20))
    before = record_identity(record)
    shard.write_bytes(b"y" * 101)  # rewritten: a new size (and time)
    _container_stat.cache_clear()  # stat'ed once per process; a new run is a new process
    assert record_identity(record) != before


def test_an_unreadable_image_is_named_by_the_fill_and_skipped_in_training(tmp_path, folder):
    (folder / "05.png").write_bytes(b"")  # zero-size
    raw = raw_config(tmp_path, folder)
    raw["data"].update(buckets="none", max_bad_fraction=0.5)
    raw["cache"]["text_embeddings"] = "none"
    config, _, records, bucket_of, encodings, report = fill(raw)
    assert report.unreadable == [str(folder / "05.png")] and report.latents_encoded == 18
    dataset = ImageCaptionDataset(records, 64, "center", True, 3, bucket_of=bucket_of,
                                  cache=encodings)  # fmt: skip
    skipped = dataset[(0, 5)]
    assert isinstance(skipped, Skipped) and "unreadable when the cache was filled" in skipped.reason
    result = train(config)
    assert result.state.images_bad >= 1
    assert (
        "05.png\tunreadable when the cache was filled"
        in (result.run_dir / "bad-data.tsv").read_text()
    )


def test_repeated_records_are_hashed_once(tmp_path, folder, monkeypatch) -> None:
    from impasto.data import cache as cache_module

    calls = []
    real = cache_module.compute_image_id
    monkeypatch.setattr(cache_module, "compute_image_id", lambda r: calls.append(r) or real(r))
    raw = raw_config(tmp_path, folder)
    del raw["data"]["path"]
    raw["data"]["sources"] = [{"path": str(folder), "repeats": 3}]
    raw["cache"]["dir"] = str(tmp_path / "cache")
    config = build_config(raw)
    records, ids = identify_images(config, load_records(config))
    assert len(records) == 30 and len(calls) == 10
    assert ids[0] == ids[1] == ids[2] != ids[3] and records[2].size == (ids[2].height, ids[2].width)


def test_a_damaged_text_entry_is_encoded_on_the_fly_and_reported_once(tmp_path, folder) -> None:
    raw = raw_config(tmp_path, folder)
    raw["data"].update(buckets="none", random_flip=False)
    raw["cache"]["latents"] = "none"  # pixels decoded, text from the cache
    config, _, records, _, encodings, _ = fill(raw)
    caption = records[1].caption
    name = f"{text_key(caption, encodings.text_fingerprint, 'float32')}.embeds"
    rot_entry(encodings.store.shards[encodings.store.where[name]], name)
    assert encodings.prompt("a caption never cached") is None  # missing is not damaged

    dataset = ImageCaptionDataset(records, 64, "center", False, 3, cache=encodings)
    damaged, clean = dataset[(0, 1)], dataset[(0, 2)]
    assert damaged.prompt_embeds is None and clean.prompt_embeds is not None
    assert clean.reencoded is None and damaged.reencoded.name == text_embedding_name(caption)
    assert "fails its checksum" in damaged.reencoded.reason
    assert "re-encoded on the fly" in damaged.reencoded.reason
    batch = collate_examples([damaged, clean])
    assert batch.size == 2 and batch.num_bad == 0 and batch.skipped == ()
    assert batch.prompt_embeds is None  # the batch's text is encoded on the fly, as before
    assert [item.name for item in batch.reencoded] == [text_embedding_name(caption)]

    # Two epochs through the run's data stream: met twice, handed on once (the trainer reports
    # it: tests/reliability/test_bad_data.py), never counted bad.
    log = BadDataLog(tmp_path / "bad-data.tsv")
    stream = DataStream(config, records, cache=encodings)
    reencoded, num_bad, met = [], 0, 0
    while stream.epoch < 2:
        batch = next(stream)
        reencoded += batch.reencoded
        num_bad += batch.num_bad
        met += caption in batch.captions and batch.prompt_embeds is None
    assert met == 2 and num_bad == 0
    assert [item.name for item in reencoded] == [text_embedding_name(caption)]
    log.record(reencoded)
    log.record(reencoded)  # a name the report holds is not written again
    report = (tmp_path / "bad-data.tsv").read_text(encoding="utf-8").splitlines()
    assert report == [f"{text_embedding_name(caption)}\t{reencoded[0].reason}"]


def test_a_text_embedding_name_is_one_line_per_caption() -> None:
    name = text_embedding_name('a "red"\tcube\nwith\u2028lines')
    assert name == 'cached text embedding of caption "a \\"red\\"\\tcube\\nwith\\u2028lines"'
    assert len(name.splitlines()) == 1 and "\t" not in name
    assert text_embedding_name("") == 'cached text embedding of caption ""'
