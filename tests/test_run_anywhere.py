"""A run works from any directory (issue #29): a project folder with configs that name their
data, prompt file and starting model by relative paths is trained from inside it, then sampled,
exported, summarised, cached and resumed from elsewhere, and resumed again after the whole
folder moved."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from safetensors import safe_open

from impasto.checkpoint import list_checkpoints
from impasto.cli import main

BASE = {
    "model": {"preset": "tiny"},
    "data": {"path": "data/demo", "resolution": 64, "batch_size": 4},
    "cache": {"latents": "disk", "text_embeddings": "disk"},  # in data/demo/.impasto-cache
    "optim": {"lr": 1e-3, "weight_decay": 0.0},
    "train": {"output_dir": "runs/base", "seed": 0, "max_steps": 2},
    "checkpoint": {"every_steps": 2},
    "sample": {"every_steps": 2, "prompts_file": "prompts.txt", "num_steps": 2},
    "log": {"tensorboard": False, "progress_bar": False},
}
# A LoRA on the run above: its starting model is that run, named relative to this file.
LORA = BASE | {
    "model": {"path": "runs/base"},
    "parts": {"unet": "lora"},
    "lora": {"rank": 4},
    "train": BASE["train"] | {"output_dir": "runs/lora"},
}


def make_project(root: Path, demo_folder: Path) -> Path:
    shutil.copytree(demo_folder, root / "data" / "demo")
    (root / "prompts.txt").write_text("a red circle on a white background\n", encoding="utf-8")
    for name, raw in (("base.yaml", BASE), ("lora.yaml", LORA)):
        (root / name).write_text(yaml.safe_dump(raw), encoding="utf-8")
    return root


def steps(run_dir: Path) -> list[str]:
    return [path.name for path in list_checkpoints(run_dir / "checkpoints")]


def test_a_run_works_from_any_directory_and_after_its_folder_moved(
    tmp_path, demo_folder, monkeypatch, capsys
):
    project = make_project(tmp_path / "project", demo_folder)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(project)
    assert main(["train", "base.yaml"]) == 0
    assert main(["train", "lora.yaml"]) == 0
    stored = yaml.safe_load((project / "runs" / "lora" / "config.yaml").read_text())
    assert stored["model"]["path"] == str(project / "runs" / "base")  # recorded absolute
    assert stored["sample"]["prompts_file"] == str(project / "prompts.txt")

    monkeypatch.chdir(elsewhere)
    run = project / "runs" / "lora"
    assert main(["sample", str(run), "--prompt", "a blue square", "--out", "samples"]) == 0
    assert len(list((elsewhere / "samples").glob("*.png"))) == 1
    assert main(["export", str(run), "--format", "lora-kohya", "--out", "lora.safetensors"]) == 0
    with safe_open(elsewhere / "lora.safetensors", framework="pt") as exported:
        assert any(key.startswith("lora_unet_") for key in exported.keys())
    merged = ["export", str(run), "--format", "single-file", "--merge", "--out", "m.safetensors"]
    assert main(merged) == 0
    assert main(["runs", "summary", str(run)]) == 0
    assert main(["runs", "list", str(project / "runs")]) == 0
    assert main(["cache", str(project / "base.yaml")]) == 0
    capsys.readouterr()

    # Resumed from elsewhere: the run in the project continues; nothing appears here.
    assert main(["train", str(project / "lora.yaml"), "--set", "train.max_steps=4"]) == 0
    assert steps(run) == ["step-00000002", "step-00000004"]
    assert sorted(path.name for path in elsewhere.iterdir()) == [
        "lora.safetensors", "m.safetensors", "samples"
    ]  # fmt: skip

    # The whole folder moves (its configs, data, prompt file and runs); from a third directory
    # the moved config still finds its starting model, its data and its run, and resumes.
    moved = tmp_path / "moved"
    project.rename(moved)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["train", str(moved / "lora.yaml"), "--set", "train.max_steps=6"]) == 0
    out = capsys.readouterr().out
    assert "resum" in out and "step-00000004" in out, out
    assert steps(moved / "runs" / "lora") == ["step-00000002", "step-00000004", "step-00000006"]
    assert (moved / "runs" / "lora" / "samples" / "step-00000006.png").is_file()  # prompts.txt
    assert main(["sample", str(moved / "runs" / "lora"), "--prompt", "x", "--out", "after"]) == 0
