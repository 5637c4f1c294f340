"""The presets users copy: each trains on the tiny model with exactly the commands its comments
give, and the `--set` lines that point it at a user's model and data resolve as promised."""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

import pytest

from impasto.cli import main
from impasto.config import load_config

CONFIGS = Path(__file__).parents[1] / "configs"
PRESETS = ("sdxl-lora.yaml", "sdxl-full.yaml", "sdxl-dreambooth.yaml", "sdxl-vpred-lora.yaml")
SMOKE_HEADING = "Smoke test"


def commented_commands(path: Path) -> tuple[list[list[str]], list[list[str]]]:
    """The ``impasto`` commands in the file's leading comment, continuation lines joined:
    ``(for the user's model, the smoke test)``, split as a shell would."""
    user, smoke = [], []
    current = user
    pending = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if SMOKE_HEADING in text:
            current = smoke
        text = pending + " " + text if pending else text
        if text.endswith("\\"):
            pending = text[:-1].strip()
            continue
        pending = ""
        if text.startswith("impasto "):
            current.append(shlex.split(text)[1:])
    return user, smoke


@pytest.mark.parametrize("name", PRESETS)
def test_the_set_lines_point_the_preset_at_the_users_model(name: str):
    user, smoke = commented_commands(CONFIGS / name)
    trains = [args for args in user if args[0] == "train"]
    assert trains and smoke, "the comments give a training command and a smoke test"
    for args in trains:
        overrides = [args[i + 1] for i, arg in enumerate(args) if arg == "--set"]
        assert any(o.startswith("model.path=") for o in overrides)
        config = load_config(CONFIGS / name, overrides)
        # --set paths are relative to the working directory (the file's to its folder)
        expected = {k: os.path.abspath(v) for k, v in (o.split("=", 1) for o in overrides)}
        assert (config.model.preset, config.model.path) == (None, expected["model.path"])
        if "data.path" in expected:
            assert config.data.path == expected["data.path"]


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_trains_two_steps_on_the_tiny_model_as_its_comments_say(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    _, smoke = commented_commands(CONFIGS / name)
    # As from the repository's root: the presets' ../data/ and ../runs/ land here.
    shutil.copytree(CONFIGS, tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    for args in smoke:
        if args[0] == "train":
            assert args[1] == f"configs/{name}"
        assert main(args) == 0, args
    config = load_config(tmp_path / "configs" / name, [a for a in smoke[-1] if "=" in a])
    assert Path(config.train.output_dir).parent == tmp_path / "runs"
    assert config.model.preset == "tiny"
    checkpoint = Path(config.train.output_dir) / "checkpoints" / "step-00000002"
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["train"]["step"] == 2, state["train"]


def test_the_dit_xl_stages_train_two_steps_each_on_the_tiny_dit_as_their_comments_say(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """configs/dit-xl.yaml (256²) and configs/dit-xl-512.yaml, which starts from its run."""
    shutil.copytree(CONFIGS, tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    for name in ("dit-xl.yaml", "dit-xl-512.yaml"):
        user, smoke = commented_commands(CONFIGS / name)
        assert user and smoke  # the commands for your data (impasto cache), the smoke test
        for args in smoke:
            assert main(args) == 0, args
    first = load_config(tmp_path / "configs" / "dit-xl.yaml")
    assert (first.model.family, first.model.preset, first.data.resolution) == ("dit", "xl", 256)
    assert (first.optim.lr, first.optim.weight_decay, first.ema.decay) == (1e-4, 0.0, 0.9999)
    assert first.parallel.strategy == "fsdp" and first.data.pack_tokens == 8192
    second = load_config(tmp_path / "configs" / "dit-xl-512.yaml")
    assert second.model.path == str(tmp_path / "runs" / "dit-xl") and second.model.preset is None
    assert second.data.resolution == 512 and second.objective == first.objective
    for run in ("dit-xl", "dit-xl-512"):
        state = tmp_path / "runs" / run / "checkpoints" / "step-00000002" / "state.json"
        assert json.loads(state.read_text())["train"]["step"] == 2
