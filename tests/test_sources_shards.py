"""Data sources beyond folders: webdataset tar shards, Parquet manifests, local HF datasets."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import shlex
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import tar_bytes
from PIL import Image

from impasto.data.sources import (
    FileRangeBlob,
    FsspecRangeBlob,
    hf,
    hf_dataset_records,
    hf_dataset_scan,
    parquet,
    parquet_records,
    parquet_scan,
    shards,
    webdataset_records,
)


def encoded_image(height: int, width: int, color: tuple[int, int, int], format: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format=format)
    return buffer.getvalue()


def write_shard(path: Path, members: list[tuple[str, bytes]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(tar_bytes(members))
    return path


RED = encoded_image(8, 12, (255, 0, 0), "PNG")
GREEN = encoded_image(16, 4, (0, 255, 0), "JPEG")
BLUE = encoded_image(6, 10, (0, 0, 255), "WEBP")


@pytest.fixture
def three_shards(tmp_path: Path) -> dict[str, bytes]:
    """shard-000000..000002.tar under tmp_path/shards; returns record name -> image bytes."""
    folder = tmp_path / "shards"
    write_shard(
        folder / "shard-000000.tar",
        [("a/0.png", RED), ("a/0.txt", b" red square \n"), ("a/0.json", b'{"caption": "no"}'),
         ("1.JPG", GREEN), ("1.caption", "grün".encode()), ("1.cls", b"3")],
    )  # fmt: skip
    write_shard(
        folder / "shard-000001.tar",
        [("2.webp", BLUE), ("2.json", json.dumps({"tags": ["blue", " wide"]}).encode()),
         ("3.json", b'{"text": "orphan"}'), ("4.png", RED), ("4.json", b'{"text": " t "}')],
    )  # fmt: skip
    write_shard(folder / "shard-000002.tar", [("5.jpeg", GREEN), ("5.json", b'{"id": 5}')])
    return {
        "shard-000000.tar/a/0.png": RED,
        "shard-000000.tar/1.JPG": GREEN,
        "shard-000001.tar/2.webp": BLUE,
        "shard-000001.tar/4.png": RED,
        "shard-000002.tar/5.jpeg": GREEN,
    }


def test_shards_expand_braces_and_read_captions_sizes_and_bytes(three_shards, tmp_path, caplog):
    records = webdataset_records(
        str(tmp_path / "shards/shard-{000000..000002}.tar"), tmp_path / "index"
    )
    assert [record.image_path for record in records] == list(three_shards)
    captions = ["red square", "grün", "blue, wide", "t", ""]
    assert [record.caption for record in records] == captions
    assert [record.size for record in records] == [(8, 12), (16, 4), (6, 10), (8, 12), (16, 4)]
    assert [record.read_bytes() for record in records] == list(three_shards.values())
    assert all(isinstance(record.blob, FileRangeBlob) for record in records)
    assert "shard-000001.tar: skipped 1 samples" in caplog.text
    listed = webdataset_records(
        [
            str(tmp_path / "shards/shard-000002.tar"),
            "file:" + str(tmp_path / "shards/shard-00000{0,1}.tar"),
        ],
        tmp_path / "index",
    )
    names = list(three_shards)
    assert [record.image_path for record in listed] == [names[-1], *names[:-1]]


def test_unreadable_image_gets_no_size_and_does_not_raise(tmp_path):
    shard = write_shard(tmp_path / "bad.tar", [("0.jpg", b"not an image"), ("1.png", RED)])
    records = webdataset_records(str(shard), tmp_path / "index")
    assert [record.size for record in records] == [None, (8, 12)]
    assert records[0].read_bytes() == b"not an image"


def test_local_index_is_reused_and_rebuilt_when_the_shard_changes(tmp_path, monkeypatch):
    scans = []
    scan_tar = shards._scan_tar
    monkeypatch.setattr(shards, "_scan_tar", lambda *args: scans.append(args[1]) or scan_tar(*args))
    shard = write_shard(tmp_path / "s.tar", [("0.png", RED), ("0.txt", b"first")])
    index_dir = tmp_path / "index"
    assert webdataset_records(str(shard), index_dir)[0].caption == "first"
    assert webdataset_records(str(shard), index_dir)[0].caption == "first"
    assert scans == ["s.tar"]
    assert len(list(index_dir.glob("*.json"))) == 1
    write_shard(shard, [("0.png", RED), ("0.txt", b"second")])
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert webdataset_records(str(shard), index_dir)[0].caption == "second"
    assert scans == ["s.tar", "s.tar"]


def test_pipe_url_is_copied_once_and_read_from_the_copy(tmp_path):
    shard = write_shard(tmp_path / "p.tar", [("0.png", RED), ("0.txt", b"piped"), ("1.jpg", GREEN)])
    runs = tmp_path / "runs.log"
    url = "pipe:" + shlex.join(["sh", "-c", f"echo run >> {runs}; cat {shard}"])
    index_dir = tmp_path / "index"
    first = webdataset_records(url, index_dir)
    second = webdataset_records(url, index_dir)
    assert runs.read_text() == "run\n"
    assert first == second
    assert [record.caption for record in first] == ["piped", ""]
    assert [copy.stat().st_size for copy in (index_dir / "shards").glob("*.tar")] == [
        shard.stat().st_size
    ]
    shard.unlink()
    assert [record.read_bytes() for record in first] == [RED, GREEN]


def test_pipe_command_failure_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"exited with status 1; run it in a shell") as error:
        webdataset_records(f"pipe:cat {tmp_path / 'missing.tar'} 2>/dev/null", tmp_path / "i")
    assert "\n" not in str(error.value)
    assert list((tmp_path / "i" / "shards").iterdir()) == []


def test_memory_fsspec_url_reads_byte_ranges(tmp_path):
    memory = fsspec.filesystem("memory")
    memory.pipe("/bucket/m-0.tar", tar_bytes([("0.png", RED), ("0.txt", b"in memory")]))
    memory.pipe("/bucket/m-1.tar", tar_bytes([("1.webp", BLUE)]))
    try:
        records = webdataset_records("memory://bucket/m-{0,1}.tar", tmp_path / "index")
        assert [record.image_path for record in records] == ["m-0.tar/0.png", "m-1.tar/1.webp"]
        assert records[0].blob == FsspecRangeBlob("memory://bucket/m-0.tar", 512, len(RED))
        assert [record.caption for record in records] == ["in memory", ""]
        assert [record.size for record in records] == [(8, 12), (6, 10)]
        restored = pickle.loads(pickle.dumps(records))
        assert [record.read_bytes() for record in restored] == [RED, BLUE]
        assert not (tmp_path / "index" / "shards").exists()
    finally:
        memory.rm("/bucket", recursive=True)


@pytest.mark.parametrize("name", ["../evil.png", "a/../../evil.png", "/etc/evil.png"])
def test_member_outside_the_shard_is_refused(tmp_path, name):
    shard = write_shard(tmp_path / "evil.tar", [("0.png", RED), (name, RED)])
    with pytest.raises(
        ValueError, match=rf"shard evil.tar member '{name}' has an absolute or '\.\.'"
    ):
        webdataset_records(str(shard), tmp_path / "index")


@pytest.mark.parametrize("cut", ["mid_data", "mid_header", "no_end_marker", "gzip"])
def test_truncated_or_compressed_shard_is_one_line_error(tmp_path, cut):
    data = tar_bytes([("0.png", RED), ("1.png", GREEN)])
    second_header = 512 + (len(RED) + 511) // 512 * 512
    end = second_header + 512 + (len(GREEN) + 511) // 512 * 512
    damaged = {
        "mid_data": data[: second_header + 600],
        "mid_header": data[: second_header + 100],
        "no_end_marker": data[:end],
        "gzip": gzip.compress(data),
    }[cut]
    shard = tmp_path / "cut.tar"
    shard.write_bytes(damaged)
    with pytest.raises(ValueError, match=r"shard cut.tar is truncated or not an uncompressed tar"):
        webdataset_records(str(shard), tmp_path / "index")
    assert data[end:] == bytes(len(data) - end)  # the cut really dropped only the end marker


def test_missing_shard_names_it(tmp_path):
    with pytest.raises(ValueError, match=r"shard .*nope.tar does not exist"):
        webdataset_records(str(tmp_path / "nope.tar"), tmp_path / "index")


def test_parquet_with_paths(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "r.png").write_bytes(RED)
    absolute = tmp_path / "g.jpg"
    absolute.write_bytes(GREEN)
    path = tmp_path / "m" / "manifest.parquet"
    path.parent.mkdir()
    table = {
        "image": ["../images/r.png", str(absolute)],
        "caption": [" a ", None],
        "weight": [2.0, None],
    }
    pq.write_table(pa.table(table), path)
    records = parquet_records(path)
    assert [record.image_path for record in records] == [path.parent / "../images/r.png", absolute]
    assert [(record.caption, record.weight, record.blob) for record in records] == [
        ("a", 2.0, None),
        ("", 1.0, None),
    ]
    assert records[0].read_bytes() == RED


def test_parquet_with_bytes_and_hf_image_structs(tmp_path, monkeypatch):
    images = [RED, GREEN, BLUE, RED, GREEN]
    structs = pa.array(
        [{"bytes": data, "path": f"{i}.png"} for i, data in enumerate(images)],
        pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
    )
    for name, column in (("binary", pa.array(images, pa.binary())), ("struct", structs)):
        path = tmp_path / f"{name}.parquet"
        captions = [f"c{i}" for i in range(5)]
        pq.write_table(pa.table({"image": column, "caption": captions}), path, row_group_size=2)
        records = parquet_records(path)
        assert [record.image_path for record in records] == [
            f"{name}.parquet/row-{n}" for n in range(1, 6)
        ]
        assert [record.caption for record in records] == captions
        assert [record.size for record in records] == [(8, 12), (16, 4), (6, 10), (8, 12), (16, 4)]
        assert [(record.blob.row_group, record.blob.row) for record in records][-2:] == [
            (1, 1),
            (2, 0),
        ]
        # A loader worker: records arrive pickled, and the worker has no open files yet.
        restored = pickle.loads(pickle.dumps(records))
        monkeypatch.setattr(parquet, "_PARQUET_FILES", {})
        assert [record.read_bytes() for record in restored] == images


@pytest.mark.parametrize(
    ("table", "reason"),
    [
        ({"image": ["a.png", None]}, "no 'image' field"),
        ({"image": ["a.png", "b.png"], "weight": [1.0, 0.0]}, "weight must be > 0 and finite"),
        ({"image": ["a.png", "b.png"], "weight": ["1", "heavy"]}, "weight 'heavy' is not a number"),
    ],
)
def test_a_bad_parquet_row_is_left_out_and_named(tmp_path, table, reason):
    pq.write_table(pa.table(table), tmp_path / "p.parquet")
    scan = parquet_scan(tmp_path / "p.parquet")
    assert [record.image_path for record in scan.records] == [tmp_path / "a.png"]
    assert [(item.name, item.reason[: len(reason)]) for item in scan.skipped] == [
        (f"{tmp_path / 'p.parquet'} row 2", reason)
    ]


def test_parquet_errors_name_the_file(tmp_path):
    pq.write_table(pa.table({"path": ["a.png"], "text": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"has no 'image' column; its columns: path, text"):
        parquet_records(tmp_path / "p.parquet")
    pq.write_table(
        pa.table({"image": [None, ""]}, pa.schema([("image", pa.string())])), tmp_path / "p.parquet"
    )
    with pytest.raises(ValueError, match=r"p.parquet has no usable rows \(.*row 1: no 'image'"):
        parquet_records(tmp_path / "p.parquet")
    (tmp_path / "p.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"p.parquet: is not a readable Parquet file"):
        parquet_records(tmp_path / "p.parquet")


@pytest.fixture
def hf_images():
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    rows = {"image": [{"bytes": data, "path": None} for data in (RED, GREEN, BLUE)]}
    rows["text"] = [" one ", None, "three"]
    return datasets.Dataset.from_dict(rows, features=features)


def test_hf_dataset_saved_to_disk(hf_images, tmp_path, monkeypatch):
    import datasets

    datasets.DatasetDict({"train": hf_images, "test": hf_images.select([2])}).save_to_disk(
        tmp_path / "dict"
    )
    hf_images.save_to_disk(tmp_path / "plain")
    records = hf_dataset_records(tmp_path / "dict")
    assert [record.image_path for record in records] == [
        "dict/train/0",
        "dict/train/1",
        "dict/train/2",
    ]
    assert [record.caption for record in records] == ["one", "", "three"]
    assert [record.size for record in records] == [(8, 12), (16, 4), (6, 10)]
    restored = pickle.loads(pickle.dumps(records))
    monkeypatch.setattr(hf, "_HF_IMAGES", {})
    assert [record.read_bytes() for record in restored] == [RED, GREEN, BLUE]
    test = hf_dataset_records(str(tmp_path / "dict"), split="test", caption_column=None)
    assert [(record.caption, record.read_bytes()) for record in test] == [("", BLUE)]
    plain = hf_dataset_records(tmp_path / "plain", split=None)
    assert [record.read_bytes() for record in plain] == [RED, GREEN, BLUE]
    with pytest.raises(ValueError, match=r"has no split 'valid'; its splits: train, test"):
        hf_dataset_records(tmp_path / "dict", split="valid")
    with pytest.raises(ValueError, match=r"has no column 'caption'; its columns: image, text"):
        hf_dataset_records(tmp_path / "plain", caption_column="caption")


def test_hf_dataset_folder_of_parquet_files_loads_offline(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    folder = tmp_path / "repo" / "data"
    folder.mkdir(parents=True)
    pq.write_table(
        pa.table({"image": [{"bytes": GREEN, "path": None}], "text": ["g"]}),
        folder / "train-0.parquet",
    )
    offline_during_load = []
    load_dataset = datasets.load_dataset

    def recording_load_dataset(*args, **kwargs):
        offline_during_load.append(datasets.config.HF_HUB_OFFLINE)
        return load_dataset(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", recording_load_dataset)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    records = hf_dataset_records(tmp_path / "repo")
    assert [(record.caption, record.size, record.read_bytes()) for record in records] == [
        ("g", (16, 4), GREEN)
    ]
    assert offline_during_load == [True]
    assert datasets.config.HF_HUB_OFFLINE is False


def test_hf_dataset_must_be_a_local_folder(tmp_path):
    with pytest.raises(ValueError, match=r"user/name is not a local folder; download it first"):
        hf_dataset_records("user/name")


def test_hf_data_files_that_do_not_load_are_left_out(hf_images, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    datasets.DatasetDict({"train": hf_images}).save_to_disk(
        tmp_path / "dict", num_shards={"train": 3}
    )
    cut = tmp_path / "dict" / "train" / "data-00002-of-00003.arrow"
    cut.write_bytes(cut.read_bytes()[:100])
    scan = hf_dataset_scan(tmp_path / "dict")
    assert [record.caption for record in scan.records] == ["one", ""]
    assert [(item.name, item.reason[:24]) for item in scan.skipped] == [
        (str(cut), "Arrow file does not load")
    ]
    monkeypatch.setattr(hf, "_HF_IMAGES", {})  # a loader worker loads the same files
    assert [record.read_bytes() for record in scan.records] == [RED, GREEN]
    folder = tmp_path / "repo" / "data"
    folder.mkdir(parents=True)
    for index, image in enumerate((RED, GREEN)):
        table = pa.table({"image": [{"bytes": image, "path": None}], "text": [f"t{index}"]})
        pq.write_table(table, folder / f"train-{index}.parquet")
    (folder / "train-2.parquet").write_bytes(b"PAR1 garbage")
    scan = hf_dataset_scan(tmp_path / "repo")
    assert [(record.caption, record.read_bytes()) for record in scan.records] == [
        ("t0", RED),
        ("t1", GREEN),
    ]
    assert [item.name for item in scan.skipped] == [str(folder / "train-2.parquet")]
