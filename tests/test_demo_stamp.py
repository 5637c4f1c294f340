"""The demo data a run writes (``data.generate_demo``) is written whole and stamped with its
settings; a config that asks for other demo data stops with one line instead of training on
the old folder (:mod:`impasto.data.demo_stamp`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import impasto.data.records as records
from impasto.config import build_config
from impasto.data.demo_stamp import STAMP
from impasto.data.holdout import generate_missing_demo_sets
from impasto.data.records import scan_sources


@pytest.fixture
def demo_raw(tiny_raw: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    tiny_raw["data"] |= {"path": str(tmp_path / "demo"), "generate_demo": True,
                         "demo_num_images": 6}  # fmt: skip
    return tiny_raw


def test_a_run_writes_stamped_demo_data_and_reuses_it_for_another_seed(demo_raw, tmp_path):
    scan = scan_sources(build_config(demo_raw))
    folder = tmp_path / "demo"
    assert len(scan.records) == 6 and len(list(folder.glob("*.png"))) == 6  # not the stamp
    stamp = json.loads((folder / STAMP).read_text())
    assert stamp == {"generator": "demo images 1", "demo_num_images": 6, "resolution": 64,
                     "demo_sizes": None}  # fmt: skip
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []
    before = {path: path.stat().st_mtime_ns for path in folder.iterdir()}
    demo_raw["train"]["seed"] = 1  # another sample of the same data: the folder is reused
    assert len(scan_sources(build_config(demo_raw)).records) == 6
    assert {path: path.stat().st_mtime_ns for path in folder.iterdir()} == before


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"demo_num_images": 12}, "demo_num_images 6 there, 12 in this config"),
        ({"resolution": 32}, "resolution 64 there, 32 in this config"),
        ({"demo_sizes": [[48, 80]]}, "demo_sizes null there, [[48, 80]] in this config"),
    ],
)
def test_other_demo_settings_stop_with_one_line_that_names_them(demo_raw, tmp_path, change, named):
    scan_sources(build_config(demo_raw))
    demo_raw["data"] |= change
    with pytest.raises(ValueError) as raised:
        scan_sources(build_config(demo_raw))
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"data.path: {tmp_path / 'demo'} holds")
    assert named in message
    assert f"delete {tmp_path / 'demo'} to write the demo data again" in message
    assert len(list((tmp_path / "demo").glob("*.png"))) == 6  # nothing deleted or rewritten


def test_a_newer_generator_stops_a_folder_an_older_one_wrote(demo_raw, tmp_path, monkeypatch):
    scan_sources(build_config(demo_raw))
    monkeypatch.setattr(records, "DEMO_GENERATOR", 2)
    with pytest.raises(ValueError, match='generator "demo images 1" there, "demo images 2"'):
        scan_sources(build_config(demo_raw))


def test_an_interrupted_write_leaves_no_data_folder_and_the_next_run_writes_it(
    demo_raw, tmp_path, monkeypatch
):
    written = records.write_demo_dataset

    def interrupted(folder: Path, *args: Any, **kwargs: Any) -> int:
        written(folder, 2, 64)  # two images, then the user presses Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(records, "write_demo_dataset", interrupted)
    with pytest.raises(KeyboardInterrupt):
        scan_sources(build_config(demo_raw))
    assert not (tmp_path / "demo").exists()  # no half dataset to train on later
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []
    monkeypatch.setattr(records, "write_demo_dataset", written)
    assert len(scan_sources(build_config(demo_raw)).records) == 6


def test_a_folder_without_a_stamp_is_used_and_a_broken_stamp_is_one_line(demo_raw, tmp_path):
    scan_sources(build_config(demo_raw))
    stamp = tmp_path / "demo" / STAMP
    stamp.unlink()  # as written before stamps, or by `impasto data demo`
    demo_raw["data"]["demo_num_images"] = 12
    assert len(scan_sources(build_config(demo_raw)).records) == 6
    stamp.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=r"^data.path: the demo stamp .* cannot be read; delete"):
        scan_sources(build_config(demo_raw))


def test_a_held_out_set_is_stamped_and_checked_too(demo_raw, tmp_path):
    held_out = tmp_path / "held-out"
    demo_raw["eval"] = {"every_steps": 5, "max_images": 4,
                        "sets": [{"name": "demo-held-out", "path": str(held_out)}]}  # fmt: skip
    generate_missing_demo_sets(build_config(demo_raw))
    assert len(list(held_out.glob("*.png"))) == 4
    assert json.loads((held_out / STAMP).read_text())["resolution"] == 64
    demo_raw["eval"]["max_images"] = 2  # reads the first 2 of the 4: not another set
    generate_missing_demo_sets(build_config(demo_raw))
    demo_raw["data"]["resolution"] = 32
    with pytest.raises(ValueError, match=r"^eval.sets demo-held-out: .* \(resolution 64 there, 32"):
        generate_missing_demo_sets(build_config(demo_raw))
