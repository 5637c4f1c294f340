"""The metrics sinks (issue #18): what TensorBoard's event files and an offline wandb run hold,
read back with TensorBoard's reader and from the wandb run's own record file."""

from __future__ import annotations

import json
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from impasto.config.schema import WandbConfig
from impasto.logging import MetricsLogger
from impasto.logging.wandb_sink import RUN_ID_FILE

BLOCK = 32768  # a .wandb file is a LevelDB-style log: 32 KiB blocks of (crc, length, type) records


def image() -> torch.Tensor:
    """A ``[3, 4, 6]`` image in [0, 1] whose pixels are exact multiples of 1/255."""
    levels = torch.arange(3 * 4 * 6, dtype=torch.float32).reshape(3, 4, 6)
    return levels * 3 / 255


def expected_pixels() -> np.ndarray:
    return (image() * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


def log_some(metrics: MetricsLogger, steps: range) -> None:
    for step in steps:
        metrics.log(step, {"loss": 1 / step, "lr": 1e-3, "note": "not a number"})
    metrics.log(steps[-1], {"val/reward": 0.25})
    metrics.log_image("samples", image(), steps[-1])


def test_tensorboard_event_files_hold_the_scalar_and_image_tags(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = MetricsLogger(tmp_path, jsonl=False, tensorboard=True, resume_step=0)
    log_some(metrics, range(1, 4))
    metrics.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    tags = events.Tags()
    assert set(tags["scalars"]) == {"train/loss", "train/lr", "val/reward"}
    assert tags["images"] == ["samples"]
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert [(e.step, e.value) for e in events.Scalars("val/reward")] == [(3, 0.25)]
    (samples,) = events.Images("samples")
    assert (samples.step, samples.width, samples.height) == (3, 6, 4)
    png = tmp_path / "samples.png"
    png.write_bytes(samples.encoded_image_string)
    assert np.array_equal(np.asarray(Image.open(png).convert("RGB")), expected_pixels())


@pytest.fixture
def quiet_offline_wandb(tmp_path, monkeypatch) -> None:
    """wandb offline, quiet, with its settings and caches in ``tmp_path`` (no network)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    for name in ("CONFIG", "CACHE", "DATA", "ARTIFACT"):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / f"wandb-{name.lower()}"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of a ``.wandb`` file (wandb ships no Python reader since 0.19)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)  # ident, magic, version
    position, pending = 7, b""
    while position + 7 <= len(data):
        if BLOCK - position % BLOCK < 7:  # a block's tail too short for a header is padding
            position += BLOCK - position % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE.../LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def history(run: Path) -> dict[int, dict[str, Any]]:
    """Step → {key: value} of the history rows of one offline run directory."""
    (path,) = run.glob("run-*.wandb")
    rows = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            rows[items.pop("_step")] = items
    return rows


def settled_history(run: Path, steps: list[int], seconds: float = 30.0) -> dict[int, dict]:
    """The history of ``run`` once it holds ``steps``, or as it is after ``seconds``: wandb's
    service writes a finished offline run's records on its own time (under a full suite on 2
    cores, a resumed run's rows were once not yet there when ``finish()`` returned)."""
    deadline = time.monotonic() + seconds
    while sorted(rows := history(run)) != steps and time.monotonic() < deadline:
        time.sleep(0.2)
    return rows


def run_record(run: Path) -> Any:
    """The run record (id, config, ...) of one offline run directory."""
    (path,) = run.glob("run-*.wandb")
    return next(r.run for r in wandb_records(path) if r.WhichOneof("record_type") == "run")


def run_config(run: Path) -> dict[str, Any]:
    return {item.key: json.loads(item.value_json) for item in run_record(run).config.update}


def test_a_wandb_offline_run_writes_its_files(tmp_path, quiet_offline_wandb) -> None:
    settings = WandbConfig(enabled=True, project="impasto-test", mode="offline")
    config = {"optim": {"lr": 1e-3}, "train": {"max_steps": 3}}
    metrics = MetricsLogger(tmp_path, False, False, 0, wandb=settings, config=config)
    log_some(metrics, range(1, 4))
    metrics.close()
    run_id = (tmp_path / RUN_ID_FILE).read_text().strip()
    (run,) = offline_runs(tmp_path)
    assert run_record(run).run_id == run_id
    rows = history(run)
    assert sorted(rows) == [1, 2, 3]
    assert rows[1]["train/loss"] == 1.0 and rows[2]["train/loss"] == 0.5
    assert rows[3]["train/lr"] == 1e-3 and rows[3]["val/reward"] == 0.25
    assert not any("note" in key for row in rows.values() for key in row)  # scalars only
    assert rows[3]["samples/_type"] == "image-file"
    png = run / "files" / rows[3]["samples/path"]
    assert np.array_equal(np.asarray(Image.open(png).convert("RGB")), expected_pixels())
    assert run_config(run)["optim"] == {"lr": 1e-3}


def test_a_resumed_run_appends_to_its_wandb_run_after_the_checkpoint(
    tmp_path, quiet_offline_wandb
) -> None:
    settings = WandbConfig(enabled=True, mode="offline")
    first = MetricsLogger(tmp_path, False, False, 0, wandb=settings)
    log_some(first, range(1, 5))  # interrupted after step 4, its checkpoint at step 2
    first.close()
    run_id = (tmp_path / RUN_ID_FILE).read_text().strip()
    # wandb names a session's folder by the second it started and the run id; two sessions of
    # one run in one second (never a real resume) once lost the second one's run record.
    time.sleep(1.1)
    resumed = MetricsLogger(tmp_path, False, False, 2, wandb=settings)
    resumed.log(2, {"loss": 9.0})  # at or before the checkpoint: not logged again
    log_some(resumed, range(3, 6))
    resumed.close()
    assert (tmp_path / RUN_ID_FILE).read_text().strip() == run_id
    runs = offline_runs(tmp_path)  # one directory per session (wandb sync uploads both)
    # The id from the record file's name: wandb writes the run record of a resumed offline run
    # asynchronously, and it was once missing right after finish() on a loaded machine.
    assert [[path.name for path in run.glob("run-*.wandb")] for run in runs] == [
        [f"run-{run_id}.wandb"]
    ] * 2
    assert sorted(settled_history(runs[1], [3, 4, 5])) == [3, 4, 5]
    fresh = MetricsLogger(tmp_path, False, False, 0, wandb=settings)  # started over: a new run
    fresh.close()
    assert (tmp_path / RUN_ID_FILE).read_text().strip() != run_id


def test_wandb_enabled_without_the_package_names_the_fix(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    settings = WandbConfig(enabled=True)
    with pytest.raises(ValueError, match=r"pip install wandb .*pip install -e '\.\[wandb\]'"):
        MetricsLogger(tmp_path, True, True, 0, wandb=settings)
    assert list(tmp_path.iterdir()) == []  # refused before any file was opened


def test_wandb_disabled_writes_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    metrics = MetricsLogger(tmp_path, True, False, 0, wandb=WandbConfig(enabled=False))
    metrics.log(1, {"loss": 1.0})
    metrics.close()
    assert [path.name for path in tmp_path.iterdir()] == ["metrics.jsonl"]


class FakeRun:
    """What an online wandb run resumed after a crash reports: its last step was 4."""

    starting_step = 5

    def __init__(self) -> None:
        self.logged: list[int] = []

    def log(self, values: dict[str, Any], step: int) -> None:
        self.logged.append(step)

    def finish(self) -> None:
        pass


def test_a_resumed_online_run_skips_the_steps_wandb_already_has(
    tmp_path, monkeypatch, capsys
) -> None:
    """wandb drops (with a warning each) a step below its run's last: the sink skips them."""
    run = FakeRun()
    fake = type(sys)("wandb")
    fake.init = lambda **kwargs: run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    (tmp_path / RUN_ID_FILE).write_text("abc\n")
    metrics = MetricsLogger(tmp_path, False, False, 2, wandb=WandbConfig(enabled=True))
    for step in range(3, 7):
        metrics.log(step, {"loss": 1.0})
    metrics.close()
    assert run.logged == [5, 6]
    assert "wandb run abc already has steps up to 4; this session logs" in capsys.readouterr().out
