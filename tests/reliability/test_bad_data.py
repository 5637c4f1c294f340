"""Bad data never stops a run (issue #16).

A generated corpus of more than 100 bad items (broken images of every kind, captions in the
wrong encoding or not files at all, missing captions, broken and missing tar shards and
samples, bad manifest rows, an unreadable Parquet file and Arrow file, duplicates) is mixed
into the 16 demo images. Each item's expected outcome: left out, named exactly once in
``RUN/bad-data.tsv`` with a readable reason, counted once, while the good images still train.
The cache's checksums catch a shard overwritten in place; loader workers outlive SIGTERM.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import textwrap
import zlib
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import rot_entry, tar_bytes
from PIL import Image
from safetensors.torch import save_file

from impasto.config import build_config
from impasto.data import build_dataloader, scan_image_folder
from impasto.data.cache import text_key
from impasto.data.cache_fill import fill_cache, identify_images
from impasto.data.pipeline import count_total_steps, place_in_buckets, prepare_run_data
from impasto.data.records import NO_CAPTION, load_records
from impasto.data.skips import (
    BadDataCounts,
    BadDataLog,
    Reencoded,
    Skipped,
    count_bad_data,
    error_reason,
    text_embedding_name,
)
from impasto.models import build_backbone
from impasto.runs import bad_data_text, summarize_run
from impasto.train.state import TrainState
from impasto.train.trainer import train

BAD_IMAGE = "unreadable image: "
NOT_AN_IMAGE = "not an image PIL can read"


@dataclass(frozen=True)
class BadItem:
    """One bad item: the name the report gives it, a piece of the reason, and when it is met
    (``scan``: while the sources are read; ``load``: when the loader opens it)."""

    name: str
    reason: str
    when: str


def png_bytes(seed: int, size: int = 64) -> bytes:
    noise = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, format="PNG")
    return buffer.getvalue()


def jpeg_bytes(seed: int) -> bytes:
    noise = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(width: int, height: int) -> bytes:
    """A valid PNG header declaring ``width × height`` pixels (PIL refuses it on open)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunks = png_chunk(b"IHDR", header) + png_chunk(b"IDAT", zlib.compress(bytes(64)))
    return b"\x89PNG\r\n\x1a\n" + chunks + png_chunk(b"IEND", b"")


def header_bomb(image_format: str, offset: int, pack: str, side: int) -> bytes:
    """A small BMP or GIF whose header is patched to declare ``side × side`` pixels."""
    buffer = io.BytesIO()
    Image.new("P" if image_format == "GIF" else "RGB", (4, 4)).save(buffer, format=image_format)
    data = bytearray(buffer.getvalue())
    struct.pack_into(pack, data, offset, side, side)
    return bytes(data)


def write_item(path: Path, data: bytes, caption: str | None = "a bad file") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)
    return path


def broken_images(folder: Path, every: int = 1) -> list[BadItem]:
    """Files named as images that no decoder reads, each with a caption: 55 of them (``every``
    k-th only)."""
    png, jpeg, specs = png_bytes(0), jpeg_bytes(1), []
    for cut in (8, 16, 24, 33, 50, 100, 400, len(png) // 4, len(png) // 2, len(png) * 3 // 4):
        specs.append((f"cut-png-{cut}.png", png[:cut], ""))
    specs.append(("cut-png-tail.png", png[:-100], "image file is truncated"))
    for cut in (2, 4, 20, 100, 300, len(jpeg) // 4, len(jpeg) // 2, len(jpeg) * 3 // 4):
        specs.append((f"cut-jpeg-{cut}.jpg", jpeg[:cut], ""))
    for cut in (2, 10, 100):
        specs.append((f"cut-jpeg-tail-{cut}.jpeg", jpeg[:-cut], "image file is truncated"))
    for suffix in (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".PNG"):
        specs.append((f"zero-byte-{suffix[1:]}{suffix}", b"", NOT_AN_IMAGE))
    rng = np.random.default_rng(7)
    for index, suffix in enumerate((".png", ".jpg", ".webp", ".bmp") * 4):
        specs.append(
            (f"random-{index}{suffix}", rng.bytes(int(rng.integers(1, 5000))), NOT_AN_IMAGE)
        )
    texts = (b"<html>not found</html>", b'{"caption": "json"}', b"%PDF-1.4", b"GIF87", b"text")
    for index, text in enumerate(texts):
        specs.append(
            (f"wrong-content-{index}.{('png', 'jpg', 'webp')[index % 3]}", text, NOT_AN_IMAGE)
        )
    for width, height in ((100_000, 100_000), (30_000, 30_000), (1, 2**31 - 1), (65_535, 65_535)):
        specs.append((f"bomb-{width}x{height}.png", png_bomb(width, height), "too many pixels"))
    specs.append(("bomb.bmp", header_bomb("BMP", 18, "<ii", 40_000), "too many pixels"))
    specs.append(("bomb-gif.png", header_bomb("GIF", 6, "<HH", 65_535), "too many pixels"))
    return [
        BadItem(str(write_item(folder / name, data)), BAD_IMAGE + reason, "load")
        for name, data, reason in specs[::every]
    ]


CAPTION_ENCODINGS = {
    "latin-1": "café crème",
    "cp1252": "\u201csmart quotes\u201d",
    "utf-16": "a red circle",
    "shift_jis": "日本語の説明",
    "gbk": "中文描述",
    "big5": "繁體中文",
    "euc-kr": "한국어 설명",
    "koi8-r": "красный круг",
    "cp1251": "синий квадрат",
    "mac_roman": "naïve café",
    "cp437": "ça va",
    "iso-8859-7": "κόκκινος κύκλος",
}


def bad_captions(folder: Path, limit: int | None = None) -> list[BadItem]:
    """Good images whose caption file cannot be used: 19 of them (the first ``limit``)."""
    specs = [
        (
            f"caption-{encoding}.png",
            ".txt",
            text.encode(encoding),
            f"caption-{encoding}.txt is not UTF-8",
        )
        for encoding, text in CAPTION_ENCODINGS.items()
    ]
    specs += [
        ("caption-latin1.png", ".caption", "été".encode("latin-1"), "latin1.caption is not UTF-8"),
        ("caption-json-utf16.png", ".json", b"\xff\xfe{\x00}\x00", "utf16.json is not UTF-8"),
        ("caption-bad-json.png", ".json", b"{oops", "is not valid JSON"),
        ("caption-json-no-key.png", ".json", b"[1, 2]", "has no 'caption' or 'text'"),
    ]
    specs += [(f"caption-folder-{suffix[1:]}.png", suffix, None, f"{suffix} is not a file")
              for suffix in (".txt", ".caption", ".json")]  # fmt: skip
    items = []
    for index, (name, suffix, caption, reason) in enumerate(specs[:limit]):
        image = write_item(folder / name, png_bytes(100 + index), caption=None)
        if caption is None:
            image.with_suffix(suffix).mkdir()
        else:
            image.with_suffix(suffix).write_bytes(caption)
        items.append(BadItem(str(image), reason, "scan"))
    return items


def uncaptioned(folder: Path, count: int = 5) -> list[BadItem]:
    """Good images without any caption file."""
    items = []
    for index in range(count):
        image = write_item(folder / f"no-caption-{index}.png", png_bytes(200 + index), None)
        items.append(BadItem(str(image), NO_CAPTION, "scan"))
    return items


def repeated(folder: Path) -> list[BadItem]:
    """A subfolder shown 3 times per epoch holding one good and one truncated image: the bad
    one is met 3 times (and listed by the manifest too) but is one bad item."""
    write_item(folder / "rep" / "good.png", png_bytes(300), "a good repeated image")
    bad = write_item(folder / "rep" / "cut.png", png_bytes(301)[:500])
    return [BadItem(str(bad), BAD_IMAGE + "image file is truncated", "load")]


def shards(folder: Path) -> tuple[str, list[BadItem], int]:
    """Tar shards: two readable ones holding good samples and 9 bad ones, seven broken shards
    and two missing from the pattern. Returns the URL pattern, the bad items and the number of
    good samples."""
    folder.mkdir()
    good = [(f"{i}.png", png_bytes(400 + i)) for i in range(5)]
    captions = [(f"{i}.txt", f"good sample {i}".encode()) for i in range(5)]
    (folder / "good-0.tar").write_bytes(tar_bytes(
        good[:3] + captions[:3]
        + [("bad.png", png_bytes(410)[:300]), ("bad.txt", b"cut image")]
        + [("orphan.json", b'{"caption": "no image"}'), ("orphan.cls", b"3")]
        + [("latin.png", png_bytes(411)), ("latin.txt", "été".encode("latin-1"))]
        + [("badjson.png", png_bytes(412)), ("badjson.json", b"{oops")]
        + [("nocap.jpg", jpeg_bytes(413))]
    ))  # fmt: skip
    (folder / "good-1.tar").write_bytes(tar_bytes(
        good[3:] + captions[3:]
        + [("only.cls", b"1"), ("sub/only.txt", b"caption without image")]
        + [("utf16.png", png_bytes(414)), ("utf16.caption", "x".encode("utf-16"))]
    ))  # fmt: skip
    whole = tar_bytes(good[:2] + captions[:2])
    second_header = 512 + (len(good[0][1]) + 511) // 512 * 512
    with tarfile.open(fileobj=io.BytesIO(whole)) as archive:
        last = archive.getmembers()[-1]
        end = last.offset_data + (last.size + 511) // 512 * 512  # the end marker follows
    broken = {
        "cut-data": (whole[: second_header + 600], "is truncated or not an uncompressed tar"),
        "cut-header": (whole[: second_header + 100], "is truncated or not an uncompressed tar"),
        "no-end": (whole[:end], "no end-of-archive marker"),
        "garbage": (np.random.default_rng(3).bytes(4096), "not an uncompressed tar"),
        "gzip": (gzip.compress(whole), "not an uncompressed tar"),
        "empty": (b"", "not an uncompressed tar"),
        "evil": (tar_bytes([("../evil.png", good[0][1])]), "has an absolute or '..' path"),
    }
    for name, (data, _) in broken.items():
        (folder / f"{name}.tar").write_bytes(data)
    names = ["good-0", "good-1", *broken, "missing-0", "missing-1"]
    items = [BadItem(str(folder / f"{name}.tar"), why, "scan") for name, (_, why) in broken.items()]
    items += [BadItem(str(folder / f"missing-{i}.tar"), "does not exist", "scan") for i in (0, 1)]
    items += [
        BadItem("good-0.tar/bad.png", BAD_IMAGE + "image file is truncated", "load"),
        BadItem("good-0.tar/orphan", "no image member", "scan"),
        BadItem("good-0.tar/latin", "caption member latin.txt is not UTF-8", "scan"),
        BadItem("good-0.tar/badjson", "caption member badjson.json is not valid JSON", "scan"),
        BadItem("good-0.tar/nocap.jpg", NO_CAPTION, "scan"),
        BadItem("good-1.tar/only", "no image member", "scan"),
        BadItem("good-1.tar/sub/only", "no image member", "scan"),
        BadItem("good-1.tar/utf16", "caption member utf16.caption is not UTF-8", "scan"),
    ]
    return str(folder / f"{{{','.join(names)}}}.tar"), items, 5


def manifest(folder: Path, duplicate: Path, good: Path) -> tuple[Path, list[BadItem]]:
    """A JSONL manifest: one good row, one listing a bad image the folder has too, one listing
    a file that does not exist, and 8 bad rows."""
    path = folder / "rows.jsonl"
    rows = [
        json.dumps({"image": str(good), "caption": "a good row"}),
        json.dumps({"image": str(duplicate), "caption": "the same bad file again"}),
        json.dumps({"caption": "no image"}),
        json.dumps({"image": "", "caption": "empty image"}),
        json.dumps({"image": str(good), "weight": 0}),
        json.dumps({"image": str(good), "weight": -1}),
        json.dumps({"image": str(good), "weight": "heavy"}),
        "{not json",
        "[1, 2, 3]",
        '{"image": "x.png", "caption": "cut',
        json.dumps({"image": "does-not-exist.png", "caption": "a missing file"}),
    ]
    path.write_text("\n".join(rows) + "\n")
    reasons = ["no 'image' field"] * 2 + ["weight must be > 0"] * 2 + ["is not a number"]
    reasons += ["not JSON", "no 'image' field", "not JSON"]
    items = [BadItem(f"{path} line {n}", r, "scan") for n, r in enumerate(reasons, 3)]
    missing = BadItem(str(folder / "does-not-exist.png"), BAD_IMAGE + "No such file", "load")
    return path, [*items, missing]


def parquet_files(folder: Path) -> tuple[list[Path], list[BadItem], int]:
    """A Parquet file of image bytes with a row without image and one with a cut image, and a
    file that is not Parquet at all."""
    rows = folder / "rows.parquet"
    images = [png_bytes(500), png_bytes(501), None, png_bytes(502)[:200]]
    captions = ["parquet good 0", "parquet good 1", "no image", "cut image"]
    pq.write_table(pa.table({"image": images, "caption": captions}), rows, row_group_size=2)
    broken = folder / "broken.parquet"
    broken.write_bytes(b"PAR1" + np.random.default_rng(4).bytes(2000))
    items = [
        BadItem(f"{rows} row 3", "no 'image' field", "scan"),
        BadItem("rows.parquet/row-4", BAD_IMAGE, "load"),
        BadItem(str(broken), "is not a readable Parquet file", "scan"),
    ]
    return [rows, broken], items, 2


def hf_dataset(folder: Path) -> tuple[Path, list[BadItem], int] | None:
    """A saved dataset of 3 Arrow files, one cut in half: its rows are left out, the others
    train. None when ``datasets`` is not installed."""
    try:
        import datasets
    except ImportError:
        return None
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    rows = {"image": [{"bytes": png_bytes(600 + i), "path": None} for i in range(6)]}
    rows["text"] = [f"hf row {i}" for i in range(6)]
    dataset = datasets.Dataset.from_dict(rows, features=features)
    dataset.save_to_disk(folder, num_shards=3)
    cut = folder / "data-00001-of-00003.arrow"
    cut.write_bytes(cut.read_bytes()[:300])
    return folder, [BadItem(str(cut), "Arrow file does not load", "scan")], 4


@dataclass(frozen=True)
class Corpus:
    """The ``data`` config of a run mixing the demo images with the bad corpus, its bad items,
    the number of good images, and its folder."""

    data: dict
    items: list[BadItem]
    num_good: int
    root: Path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, demo_folder) -> Corpus:
    root = tmp_path_factory.mktemp("corpus")
    folder = root / "folder"
    shutil.copytree(demo_folder, folder)
    items = broken_images(folder) + bad_captions(folder) + uncaptioned(folder) + repeated(folder)
    urls, shard_items, shard_good = shards(root / "shards")
    rows, row_items = manifest(root, Path(items[0].name), sorted(folder.glob("*.png"))[0])
    parquets, parquet_items, parquet_good = parquet_files(root)
    sources = [
        {"source": "folder", "path": str(folder), "subfolders": {"rep": {"repeats": 3}}},
        {"source": "webdataset", "path": urls},
        {"source": "manifest", "path": str(rows)},
        *({"source": "manifest", "path": str(path)} for path in parquets),
    ]
    items += shard_items + row_items + parquet_items
    num_good = 16 + 1 + shard_good + parquet_good  # the manifest's good row is a demo image
    hf = hf_dataset(root / "hf")
    if hf is not None:
        sources.append({"source": "hf", "path": str(hf[0]), "split": None})
        items += hf[1]
        num_good += hf[2]
    return Corpus({"sources": sources, "index_dir": str(root / "index")}, items, num_good, root)


def test_the_corpus_holds_over_100_distinct_bad_items(corpus):
    assert len({item.name for item in corpus.items}) == len(corpus.items) >= 100


def corpus_config(corpus_data: dict, tmp_path: Path, **data) -> dict:
    return {
        "model": {"preset": "tiny"},
        "data": {**corpus_data, "resolution": 64, "batch_size": 4, "max_bad_fraction": 0.9, **data},
        "optim": {"lr": 1e-3, "weight_decay": 0.0},
        "train": {"output_dir": str(tmp_path / "run"), "seed": 0, "max_steps": 3},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }


def test_every_bad_item_is_reported_once_with_a_readable_reason(corpus, tmp_path, capsys):
    items, num_good = corpus.items, corpus.num_good
    config = build_config(corpus_config(corpus.data, tmp_path))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    data = prepare_run_data(config, None, run_dir, True, None, "float32")
    assert "left out" in capsys.readouterr().out
    scanned = [item for item in items if item.when == "scan"]
    assert sorted(item.name for item in data.scan_skipped) == sorted(i.name for i in scanned)
    # Two epochs: a bad file met again (later epoch, repeats, two sources) counts once.
    stream, num_bad, trained, counters = data.stream, 0, set(), TrainState()
    while stream.epoch < 2:
        batch = next(stream)
        num_bad += batch.num_bad
        counters.count_bad(item.name for item in batch.skipped)  # as the trainer does
        data.bad_data.record(batch.skipped)
        trained |= {str(data.records[i].image_path) for i in batch.indices.tolist()}
    assert num_bad == counters.images_bad == sum(item.when == "load" for item in items)
    assert len(trained) == num_good  # every good image trained, none of the bad ones
    report = (run_dir / "bad-data.tsv").read_text(encoding="utf-8")
    assert "object at 0x" not in report and "<_io" not in report
    lines = dict(line.split("\t") for line in report.splitlines())
    assert len(lines) == len(report.splitlines()) == len(items)
    for item in items:
        assert item.name in lines, item
        assert item.reason in lines[item.name], (item, lines[item.name])
    # The same data again (a resumed run, its counters from the checkpoint): the report
    # is complete and nothing counts twice.
    again = prepare_run_data(config, None, run_dir, True, None, "float32")
    resumed = TrainState()
    resumed.load_state_dict(json.loads(json.dumps(counters.state_dict())))
    for _ in range(20):
        batch = next(again.stream)
        assert resumed.count_bad(item.name for item in batch.skipped) == 0
        again.bad_data.record(batch.skipped)
    assert report == (run_dir / "bad-data.tsv").read_text(encoding="utf-8")


def test_too_many_bad_items_or_nothing_readable_is_one_line(corpus, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"\d+ of \d+ images unusable \(\d+ without a caption, \d+ unreadable\); allowed: ",
    ):
        load_records(build_config(corpus_config(corpus.data, tmp_path, max_bad_fraction=0.2)))
    broken = {"source": "webdataset", "path": str(corpus.root / "shards/{garbage,empty}.tar")}
    only_broken = {"sources": [broken], "index_dir": corpus.data["index_dir"]}
    with pytest.raises(ValueError, match=r"no readable images; shard .*garbage.tar") as error:
        load_records(build_config(corpus_config(only_broken, tmp_path)))
    assert "\n" not in str(error.value)


def test_a_tiny_run_on_bad_data_finishes_and_counts_each_bad_item_once(tmp_path, demo_folder):
    folder = tmp_path / "data"
    shutil.copytree(demo_folder, folder)
    load_bad = broken_images(folder, every=6)  # 10, a few of each kind
    scan_bad = bad_captions(folder, limit=5) + uncaptioned(folder, count=2)
    raw = corpus_config({"path": str(folder)}, tmp_path, max_bad_fraction=0.6)
    raw["train"]["max_steps"] = 7  # 26 images: one epoch, every image met at least once
    result = train(build_config(raw))
    assert result.state.step == 7 and not result.interrupted
    report = (result.run_dir / "bad-data.tsv").read_text(encoding="utf-8").splitlines()
    names = [line.split("\t")[0] for line in report]
    assert sorted(names) == sorted(item.name for item in load_bad + scan_bad)
    assert "object at 0x" not in "\n".join(report)
    counted_at_scan = result.state.images_bad - len(load_bad)
    assert counted_at_scan in (0, len(scan_bad))  # 0 until the trainer counts scan_skipped


def test_a_reason_never_shows_an_object_repr():
    try:
        Image.open(io.BytesIO(b"not an image"))
    except OSError as error:  # PIL: "cannot identify image file <_io.BytesIO object at 0x...>"
        assert "object at 0x" in str(error)
        assert (
            error_reason(error) == f"{NOT_AN_IMAGE} (unknown format, or an empty or damaged header)"
        )
    wrapped = OSError(f"broken data stream when reading {io.BytesIO()!r}\n  more")
    assert error_reason(wrapped) == "broken data stream when reading"
    assert error_reason(SyntaxError()) == "SyntaxError"
    assert error_reason(FileNotFoundError(2, "No such file or directory", "/x.png")) == (
        "No such file or directory: /x.png"
    )
    not_utf8 = UnicodeDecodeError("utf-8", b"caf\xe9", 3, 4, "invalid continuation byte")
    assert error_reason(not_utf8) == "not UTF-8 (byte 0xe9 at offset 3)"


# --- the cache ------------------------------------------------------------------------------


def cache_config(folder: Path, run_dir: Path, cache_dir: Path) -> dict:
    return {
        "model": {"preset": "tiny"},
        "data": {"path": str(folder), "resolution": 64, "batch_size": 4},
        "cache": {
            "latents": "disk",
            "text_embeddings": "disk",
            "dtype": "float32",
            "dir": str(cache_dir),
            "shard_size_mb": 1,
        },  # fmt: skip
        "optim": {"lr": 1e-3, "weight_decay": 0.0},
        "train": {"output_dir": str(run_dir), "seed": 0, "max_steps": 3},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }


def overwrite_entries(shard: Path, keep_mtime: bool = False) -> None:
    """Overwrite a safetensors file's tensor bytes in place with garbage of the same length."""
    data = bytearray(shard.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    data[start:] = np.random.default_rng(9).bytes(len(data) - start)
    stat = shard.stat()
    shard.write_bytes(bytes(data))
    if keep_mtime:  # bit rot: the file changed, its stat did not
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_a_shard_overwritten_in_place_is_set_aside_and_encoded_again(tmp_path, demo_folder, capsys):
    cache_dir = tmp_path / "cache"
    fresh = train(build_config(cache_config(demo_folder, tmp_path / "fresh", cache_dir)))
    shards = sorted((cache_dir / "shards").glob("*.safetensors"))
    overwrite_entries(shards[0])
    capsys.readouterr()
    repaired = train(build_config(cache_config(demo_folder, tmp_path / "repaired", cache_dir)))
    out = capsys.readouterr().out
    assert f"cache shard {shards[0].name} is damaged" in out and "set aside" in out
    assert shards[0].with_suffix(".corrupt").exists() and not shards[0].exists()
    assert repaired.state.images_bad == 0
    assert losses(repaired.run_dir) == losses(fresh.run_dir)  # the same as encoding afresh


def test_a_rotten_entry_is_skipped_and_reported_then_encoded_again(tmp_path, demo_folder):
    cache_dir = tmp_path / "cache"
    config = build_config(cache_config(demo_folder, tmp_path / "run", cache_dir))
    backbone = build_backbone(config)

    def fill():
        records, ids = identify_images(config, load_records(config))
        bucket_of = place_in_buckets(config, records, None)
        return fill_cache(config, backbone, records, ids, bucket_of, nullcontext, "None")

    encodings, first = fill()
    assert first.latents_encoded == 16 and first.damaged_shards == []
    latents = sorted((cache_dir / "shards").glob("latents-*.safetensors"))
    overwrite_entries(latents[0], keep_mtime=True)
    loader, _ = build_dataloader(load_records(config), 64, "center", False, 4, 0, cache=encodings)
    skipped = [item for batch in loader for item in batch.skipped]
    assert skipped and all("fails its checksum" in item.reason for item in skipped)
    assert all(item.name.startswith(str(demo_folder)) for item in skipped)
    _, second = fill()  # the reader asked the next fill to check that shard again
    assert second.damaged_shards == [latents[0].name] and second.latents_encoded == 16
    old = cache_dir / "shards" / "old.safetensors"  # written before checksums: read unchecked
    save_file({"unused.mean": torch.zeros(2)}, str(old))
    _, third = fill()
    assert third.unchecked_shards == 1 and third.damaged_shards == []
    assert "1 shard(s) were written without checksums" in third.format()


def test_a_rotten_text_embedding_is_reencoded_and_reported_once(tmp_path, demo_folder, capsys):
    cache_dir = tmp_path / "cache"
    raw = cache_config(demo_folder, tmp_path / "clean", cache_dir)
    raw["train"]["max_steps"] = 8  # 16 images in batches of 4: two epochs
    clean = train(build_config(raw))
    config = build_config(raw)
    records, ids = identify_images(config, load_records(config))
    encodings, report = fill_cache(
        config, build_backbone(config), records, ids, None, nullcontext, "None"
    )
    assert report.texts_encoded == 0  # the keys the runs read
    caption = records[5].caption
    name = f"{text_key(caption, encodings.text_fingerprint, 'float32')}.embeds"
    rot_entry(encodings.store.shards[encodings.store.where[name]], name)

    raw["train"]["output_dir"] = str(tmp_path / "damaged")
    capsys.readouterr()
    damaged = train(build_config(raw), run_summary=lambda run: summarize_run(run).lines())
    out = capsys.readouterr().out
    assert damaged.state.step == 8 and not damaged.interrupted
    assert damaged.state.images_bad == 0  # trained on: no unusable image
    rows = (damaged.run_dir / "bad-data.tsv").read_text(encoding="utf-8").splitlines()
    assert len(rows) == 1  # met in both epochs, reported once
    row_name, reason = rows[0].split("\t")
    assert row_name == text_embedding_name(caption)
    assert "fails its checksum; re-encoded on the fly" in reason
    assert "the next `impasto cache` fill encodes it again" in reason
    summary = "  bad data: 1 text embedding re-encoded (damaged in the cache)"
    assert summary in out  # the end-of-run summary
    assert summary in summarize_run(damaged.run_dir).lines()[-1]  # impasto runs summary
    # What is trained is what encoding the caption afresh gives: the clean run's, up to
    # float rounding (the caption's batch is encoded on the fly).
    torch.testing.assert_close(losses(damaged.run_dir), losses(clean.run_dir), rtol=1e-4, atol=0)


def test_the_reports_rows_are_counted_by_kind(tmp_path):
    log = BadDataLog(tmp_path / "bad-data.tsv")
    text = text_embedding_name("a\tcube")
    log.record([Skipped(0, "a.png", "unreadable image"), Reencoded(1, text, "damaged: ...")])
    log.record([Reencoded(2, text, "damaged: met again")])
    assert len((tmp_path / "bad-data.tsv").read_text().splitlines()) == 2
    counts = count_bad_data(tmp_path / "bad-data.tsv")
    assert counts == BadDataCounts(num_left_out=1, num_reencoded=1)
    assert bad_data_text(counts) == (
        "1 item left out, 1 text embedding re-encoded (damaged in the cache)"
    )
    assert bad_data_text(BadDataCounts(3, 0)) == "3 items left out"
    assert count_bad_data(tmp_path / "absent.tsv") == BadDataCounts()


# --- loader workers and signals -------------------------------------------------------------


def test_a_loader_worker_ignores_sigterm_and_sigint(demo_folder):
    records = scan_image_folder(demo_folder)
    loader, sampler = build_dataloader(records, 32, "center", False, 4, 0, num_workers=2)
    reference, _ = build_dataloader(records, 32, "center", False, 4, 0)
    expected = [batch.indices.tolist() for batch in reference]
    iterator = iter(loader)
    first = next(iterator)
    for worker in iterator._workers:  # as Slurm does: from another process, to every worker
        for signal in ("SIGTERM", "SIGINT"):
            send = f"import os, signal; os.kill({worker.pid}, signal.{signal})"
            subprocess.run([sys.executable, "-c", send], check=True)
    rest = [batch.indices.tolist() for batch in iterator]
    assert [first.indices.tolist(), *rest] == expected
    assert all(worker.is_alive() for worker in iterator._workers)


def test_a_process_leaving_loader_workers_behind_still_exits(demo_folder):
    """Workers take their parent's SIGTERM: ``multiprocessing`` stops leftover workers that
    way at exit, and a worker ignoring it would hang the exit."""
    script = textwrap.dedent(f"""
        from impasto.data import build_dataloader, scan_image_folder
        records = scan_image_folder({str(demo_folder)!r})
        loader, _ = build_dataloader(records, 32, "center", False, 4, 0, num_workers=2)
        kept = iter(loader)
        next(kept)
        print("exiting")
    """)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "exiting", done.stderr[-2000:]
    assert "exited unexpectedly" not in done.stderr and "killed by signal" not in done.stderr


def test_a_batch_size_larger_than_the_data_is_one_line(tiny_raw):
    tiny_raw["data"]["batch_size"] = 17
    config = build_config(tiny_raw)
    with pytest.raises(ValueError, match=r"data.batch_size: 17 images per micro-step is more "
                       r"than the 16 usable images .*at most 16"):  # fmt: skip
        count_total_steps(config, 16)
    with pytest.raises(ValueError, match=r"data.batch_size: 17 x 2 ranks = 34 .* at most 8"):
        count_total_steps(config, 16, world=2)
    tiny_raw["data"]["batch_size"] = 4
    placed = [(64, 64)] * 5 + [None] * 11  # images no bucket takes do not count
    assert count_total_steps(build_config(tiny_raw), 16, placed) == 10
    with pytest.raises(ValueError, match=r"more than the 5 usable images"):
        count_total_steps(build_config(tiny_raw), 16, placed, world=2)
