"""Config: validation messages, overrides, exit codes, hashing."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

import impasto
from impasto.cli import main
from impasto.config import ConfigError, build_config, config_hash, load_config

# (dotted key, value or a callable that edits the raw mapping, fragment the message must contain)
MALFORMED = [
    ("optim.lrr", 1e-4, "optim.lrr: unknown key; did you mean 'lr'?"),
    ("optim.lr", -1, "optim.lr: input should be greater than 0, got -1"),
    ("optim.lr", "fast", "optim.lr: "),
    ("optim.name", "sgdx", "optim.name: unknown optimizer 'sgdx'"),
    ("optim.lr_schedule", "cosin", "optim.lr_schedule: unknown schedule 'cosin'"),
    ("optim.betas", [0.9, 1.5], "optim.betas: each beta must be in [0, 1)"),
    ("train.max_steps", 0, "train.max_steps: input should be greater than or equal to 1"),
    ("train.max_steps", 2.5, "train.max_steps: "),
    (
        "train.mixed_precision",
        "fp8",
        "train.mixed_precision: input should be 'auto', 'bf16', 'fp32' or 'pure_bf16'",
    ),
    ("data.resolution", 100, "data.resolution: must be a multiple of 8"),
    ("data.crop", "top", "data.crop: input should be 'center' or 'random'"),
    ("data.batch_size", "four", "data.batch_size: "),
    (
        "model.preset",
        "huge",
        "model.preset: unknown preset 'huge' of family sdxl; valid: tiny, demo, sdxl",
    ),
    ("objective.prediction_type", "eps", "objective.prediction_type: unknown name 'eps'"),
    ("objective.beta_end", 0.0001, "objective: beta_end must be > beta_start"),
    (
        "objective.zero_terminal_snr",
        True,
        "objective: zero_terminal_snr needs prediction_type: v_prediction",
    ),
    (
        "objective.timestep_bias",
        {"strategy": "later", "multiplier": 0},
        "objective: timestep_bias.multiplier must be > 0, got 0",
    ),
    (
        "objective.timestep_bias",
        {"strategy": "range", "begin": 500, "end": 400},
        "objective: timestep_bias: need begin < end <= 1000, got 500 and 400",
    ),
    ("objective.max_timestep", 1001, "objective: need 0 <= min_timestep < max_timestep <= 1000"),
    ("objective.loss_weighting", "minsnr", "objective.loss_weighting: unknown name 'minsnr'"),
    ("objective.huber_schedule", "cosine", "objective.huber_schedule: unknown name 'cosine'"),
    ("checkpoint.keep_last", 0, "checkpoint.keep_last: "),
    ("log.every", 5, "log.every: unknown key; did you mean 'every_steps'?"),
    ("trian.max_steps", 5, "trian: unknown key; did you mean 'train'?"),
    ("cache.latents", "gpu", "cache.latents: input should be 'none', 'memory' or 'disk'"),
    ("config_version", 9, "config_version: 9 is newer than this impasto supports"),
]


def _with(raw: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    raw = copy.deepcopy(raw)
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return raw


@pytest.mark.parametrize("dotted,value,fragment", MALFORMED)
def test_malformed_config_exits_2_with_one_line_naming_the_key(
    tiny_raw, tmp_path, capsys, dotted, value, fragment
):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_with(tiny_raw, dotted, value)))
    code = main(["train", str(path), "--print-config"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1, err
    assert fragment in err, err


def test_memory_latent_cache_needs_deterministic_images(tiny_raw):
    raw = _with(_with(tiny_raw, "cache.latents", "memory"), "data.random_flip", True)
    with pytest.raises(ConfigError, match=r"^config: cache.latents: 'memory' needs the same"):
        build_config(raw)
    assert build_config(_with(tiny_raw, "cache.latents", "memory")).cache.latents == "memory"


def test_missing_required_sections_and_model_source(tiny_raw):
    raw = copy.deepcopy(tiny_raw)
    del raw["data"]
    with pytest.raises(ConfigError, match=r"^data: required key is missing"):
        build_config(raw)
    with pytest.raises(ConfigError, match="set exactly one of model.preset"):
        build_config(_with(tiny_raw, "model.path", "/some/folder"))
    raw = copy.deepcopy(tiny_raw)
    del raw["train"]["max_steps"]
    with pytest.raises(ConfigError, match="set train.max_steps or train.max_epochs"):
        build_config(raw)


def test_yaml_syntax_error_and_missing_file(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  preset: tiny\n data: [\n")
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 3" in err
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_overrides_are_typed_and_validated(tiny_raw, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_raw))
    config = load_config(path, ["optim.lr=2e-4", "train.max_steps=7", "data.random_flip=true"])
    assert config.optim.lr == pytest.approx(2e-4)
    assert config.train.max_steps == 7 and isinstance(config.train.max_steps, int)
    assert config.data.random_flip is True
    with pytest.raises(ConfigError, match=r"^optim.lr: input should be greater than 0"):
        load_config(path, ["optim.lr=0"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(path, ["optim.lr"])
    with pytest.raises(ConfigError, match="optim.lr is a value, not a section"):
        load_config(path, ["optim.lr.x=1"])


def test_setting_model_path_or_preset_replaces_the_other(tiny_raw, tmp_path):
    """A preset config names model.preset: tiny; `--set model.path=...` alone points it at a
    single file (and back), while a file that names both stays an error."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_raw))
    config = load_config(path, ["model.path=/models/sd_xl_base_1.0.safetensors"])
    assert (config.model.preset, config.model.path) == (None, "/models/sd_xl_base_1.0.safetensors")
    config = load_config(path, ["model.path=/models/a.safetensors", "model.preset=tiny"])
    assert (config.model.preset, config.model.path) == ("tiny", None)
    with pytest.raises(ConfigError, match="set exactly one of model.preset"):
        load_config(path, ["model.preset=null"])
    both = tiny_raw | {"model": {"preset": "tiny", "path": "/models/a.safetensors"}}
    path.write_text(yaml.safe_dump(both))
    with pytest.raises(ConfigError, match="set exactly one of model.preset"):
        load_config(path)


def test_config_is_frozen_and_hash_tracks_content(tiny_raw):
    config = build_config(tiny_raw)
    with pytest.raises(ValidationError):
        config.optim.lr = 1.0  # type: ignore[misc]
    assert config_hash(config) == config_hash(build_config(copy.deepcopy(tiny_raw)))
    assert config_hash(config) != config_hash(build_config(_with(tiny_raw, "optim.lr", 5e-4)))
    assert len(config_hash(config)) == 16


def test_print_config_round_trips(tiny_raw, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_raw))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "impasto",
            "train",
            str(path),
            "--print-config",
            "--set",
            "optim.lr=3e-4",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    printed = yaml.safe_load(out)
    assert printed["optim"]["lr"] == pytest.approx(3e-4)
    assert printed["config_version"] == 1
    assert build_config(printed) == load_config(path, ["optim.lr=3e-4"])


def test_demo_config_is_valid():
    config = load_config(Path(__file__).parents[1] / "configs" / "demo.yaml")
    assert config.model.preset == "demo" and config.data.generate_demo


@pytest.mark.parametrize(
    "data,message",
    [
        (
            {"bucket_min_side": 96},
            "data: bucket_min_side (96) and bucket_max_side (128) must be multiples of "
            "bucket_step (64)",
        ),
        ({"bucket_min_side": 192}, "data: bucket_min_side 192 is larger than bucket_max_side 128"),
        (
            {"bucket_min_side": 128, "bucket_max_side": 256},
            "data: bucket_min_side 128 is above resolution 64",
        ),
    ],
)
def test_generated_bucket_sides_fail_at_load(tiny_raw, data, message):
    tiny_raw["data"].update(buckets="generated", resolution=64, **data)
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        build_config(tiny_raw)


@pytest.mark.parametrize("name", ["demo.yaml", "sdxl-flow.yaml", "sdxl-vpred-ztsnr.yaml"])
def test_shipped_configs_pass_the_name_checks(name):
    config = impasto.load_config(Path(__file__).parents[1] / "configs" / name)
    assert config.model.family == "sdxl" and config.objective.method == "denoise"
