"""Reading runs back: the summary's numbers are the run's own, the plot draws the logged series."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from impasto.runs import find_runs, list_runs, plot_runs, plot_series, summarize_run


def make_run(root: Path, records: list[dict], step: int, samples: int, max_steps: int = 10):
    """A run folder as the trainer writes it: config, metrics, a checkpoint, a grid."""
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(f"train:\n  max_steps: {max_steps}\n", encoding="utf-8")
    lines = [json.dumps(record) for record in records]
    (root / "metrics.jsonl").write_text("\n".join(lines) + "\n{torn", encoding="utf-8")
    checkpoint = root / "checkpoints" / f"step-{step:08d}"
    checkpoint.mkdir(parents=True)
    state = {"train": {"step": step, "samples_seen": samples}, "files": {}}
    (checkpoint / "state.json").write_text(json.dumps(state), encoding="utf-8")
    (root / "samples").mkdir()
    Image.new("RGB", (4, 4)).save(root / "samples" / f"step-{step:08d}.png")
    return root


RECORDS = [
    {"step": 1, "loss": 0.9, "lr": 1e-4, "samples_per_s": 10.0, "elapsed_s": 1.5},
    {"step": 2, "loss": 0.7, "lr": 2e-4, "samples_per_s": 14.0, "val/loss": 0.8, "mfu": 0.30},
    {"step": 3, "loss": 0.6, "lr": 2e-4, "samples_per_s": 12.0, "val/loss": 0.75, "mfu": 0.40},
    {
        "step": 4,
        "loss": 0.5,
        "lr": 1e-4,
        "samples_per_s": 16.0,
        "val/loss": 0.78,
        "elapsed_s": 3725.0,
    },
]


def test_the_summary_numbers_are_the_runs_own(tmp_path: Path):
    run = make_run(tmp_path / "runs" / "a", RECORDS, step=4, samples=32, max_steps=4)
    summary = summarize_run(run)
    assert (summary.status, summary.step, summary.total_steps) == ("finished", 4, 4)
    assert summary.images == 32
    assert summary.images_per_s == pytest.approx((10 + 14 + 12 + 16) / 4)
    assert summary.mfu == pytest.approx(0.35)
    assert summary.best_val == (0.75, 3)
    assert summary.loss == 0.5 and summary.elapsed_s == 3725.0
    assert [p.name for p in summary.checkpoints] == ["step-00000004"]
    text = "\n".join(summary.lines())
    assert "finished, step 4/4" in text and "1:02:05 training" in text and "MFU 35.0%" in text
    assert "best val/loss 0.75 at step 3" in text


def test_a_run_stopped_early_and_the_listing(tmp_path: Path):
    make_run(tmp_path / "runs" / "a", RECORDS, step=4, samples=32, max_steps=4)
    make_run(tmp_path / "runs" / "group" / "b", RECORDS[:2], step=2, samples=16, max_steps=10)
    (tmp_path / "runs" / "a" / "previous-2026-11-24").mkdir()  # archived: not listed
    assert find_runs(tmp_path / "runs") == [tmp_path / "runs/a", tmp_path / "runs/group/b"]
    assert summarize_run(tmp_path / "runs/group/b").status == "stopped"
    lines = list_runs(tmp_path / "runs")
    assert len(lines) == 2
    assert lines[1].endswith("stopped  step 2/10  loss 0.7")
    with pytest.raises(ValueError, match="no impasto runs in it"):
        list_runs(tmp_path / "runs" / "a" / "samples")
    with pytest.raises(ValueError, match="not an impasto run"):
        summarize_run(tmp_path)


def test_the_plot_draws_each_runs_logged_series(tmp_path: Path):
    a = make_run(tmp_path / "a", RECORDS, step=4, samples=32)
    b = make_run(tmp_path / "b", RECORDS[:2], step=2, samples=16)
    series = plot_series([a, b])
    assert list(series) == ["loss", "val/loss", "lr"]
    assert series["loss"]["a"] == ([1, 2, 3, 4], [0.9, 0.7, 0.6, 0.5])
    assert series["loss"]["b"] == ([1, 2], [0.9, 0.7])
    assert series["val/loss"] == {"a": ([2, 3, 4], [0.8, 0.75, 0.78]), "b": ([2], [0.8])}
    out = plot_runs([a, b], tmp_path / "curves.png")
    with Image.open(out) as image:
        assert image.size == (800, 840)  # three panels of 8 x 2.8 inches at 100 dpi


def test_the_runs_commands(tmp_path: Path, capsys, monkeypatch):
    from impasto.cli import main

    make_run(tmp_path / "runs" / "a", RECORDS, step=4, samples=32, max_steps=4)
    monkeypatch.chdir(tmp_path)
    assert main(["runs", "list"]) == 0
    assert capsys.readouterr().out.startswith("runs/a  finished  step 4/4  loss 0.5")
    assert main(["runs", "summary", "runs/a"]) == 0
    assert capsys.readouterr().out.splitlines() == summarize_run(Path("runs/a")).lines()
    assert main(["runs", "plot", "runs/a", "--out", "curves.png"]) == 0
    assert (tmp_path / "curves.png").is_file()
    assert main(["runs", "summary", "nowhere"]) == 2
    assert capsys.readouterr().err == (
        "impasto: error: nowhere: does not exist; check the run directory's path\n"
    )
    assert main(["runs", "summary", "."]) == 2
    assert "not an impasto run" in capsys.readouterr().err


def test_a_named_eval_set_stands_in_and_a_held_lock_is_running(tmp_path: Path):
    import fcntl
    import os

    records = [{"step": s, "loss": 1.0 / s, "val/demo/loss": v} for s, v in ((1, 0.9), (2, 0.8))]
    run = make_run(tmp_path / "a", records, step=2, samples=4, max_steps=4)
    summary = summarize_run(run)
    assert (summary.val_key, summary.best_val) == ("val/demo/loss", (0.8, 2))
    assert plot_series([run])["val/loss"]["a"] == ([1, 2], [0.9, 0.8])
    fd = os.open(run / ".impasto.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what a training holds
        assert summarize_run(run).status == "running"
    finally:
        os.close(fd)
    assert summarize_run(run).status == "stopped"
