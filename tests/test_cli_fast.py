"""Config errors are fast and complete (issue #13): a bad key is reported without importing
torch, diffusers or transformers, and every problem of a config is listed at once."""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

import impasto
from impasto.cli import main
from impasto.config import ConfigError, build_config

MAX_CPU_SECONDS = 2.0  # user + sys of the whole `impasto train BAD.yaml` process

UNKNOWN_KEY_LINE = (
    "impasto: error: train.bogus: unknown key; valid keys: output_dir, seed, max_steps, "
    "max_epochs, grad_accum_steps, mixed_precision, device, max_nonfinite_steps"
)


def _raw(**sections: dict[str, Any]) -> dict[str, Any]:
    """A structurally valid config (its data path is not read), sections updated by keyword."""
    raw: dict[str, Any] = {
        "model": {"preset": "tiny"},
        "data": {"path": "x"},
        "train": {"max_steps": 1},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def _write(tmp_path: Path, raw: dict[str, Any]) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_unknown_key_exits_2_in_under_two_cpu_seconds(tmp_path):
    path = _write(tmp_path, _raw(train={"bogus": 1}))
    before = _children_cpu_seconds()
    done = subprocess.run(
        [sys.executable, "-m", "impasto", "train", str(path)], capture_output=True, text=True
    )
    cpu = _children_cpu_seconds() - before
    assert done.returncode == 2, done.stderr
    assert done.stderr == UNKNOWN_KEY_LINE + "\n"
    assert cpu < MAX_CPU_SECONDS, f"{cpu:.2f} s of CPU for a config error"


def test_a_config_error_imports_no_torch_and_config_no_other_impasto_package(tmp_path):
    bad = _write(tmp_path, _raw(train={"bogus": 1}))
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(_raw()))
    script = textwrap.dedent(f"""
        import sys
        import impasto.config
        impasto.config.load_config({str(good)!r})
        print(sorted(m for m in sys.modules if m.startswith("impasto")))
        import impasto.cli
        assert impasto.cli.main(["train", {str(bad)!r}]) == 2
        print(sorted(m for m in ("torch", "diffusers", "transformers") if m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    config_modules, heavy = (yaml.safe_load(line) for line in done.stdout.splitlines())
    allowed = ("impasto", "impasto.version", "impasto.quiet")  # the root, its version, filters
    assert all(name in allowed or name.startswith("impasto.config") for name in config_modules)
    assert heavy == []


def test_every_structural_problem_is_reported_one_line_each(tmp_path, capsys):
    raw = _raw(data={"batch_size": "four"}, optim={"lrr": 1e-4}, train={"max_step": 5})
    with pytest.raises(ConfigError) as caught:
        build_config(raw)
    expected = [
        "data.batch_size: input should be a valid integer, unable to parse string as an "
        "integer, got 'four'",
        "optim.lrr: unknown key; did you mean 'lr'?",
        "train.max_step: unknown key; did you mean 'max_steps'?",
    ]
    assert str(caught.value).splitlines() == expected
    assert main(["train", str(_write(tmp_path, raw))]) == 2
    assert capsys.readouterr().err.splitlines() == [f"impasto: error: {x}" for x in expected]


def test_a_value_that_fits_no_union_member_is_one_line():
    with pytest.raises(ConfigError) as caught:
        build_config(_raw(memory={"gradient_checkpointing": 5}))
    assert str(caught.value) == (
        "memory.gradient_checkpointing: input should be 'none' or 'all', got 5"
    )


def test_every_unknown_name_is_reported_by_check_config_and_the_cli(tmp_path, capsys):
    raw = _raw(optim={"name": "sgdx"}, sample={"sampler": "heun"})
    config = build_config(raw)  # the structure is right: names are not checked here
    assert config.optim.name == "sgdx"
    expected = [
        "optim.name: unknown optimizer 'sgdx'; valid: adafactor, adamw, adamw_8bit, "
        "adamw_bf16_sr, prodigy",
        "sample.sampler: unknown name 'heun'; valid: ddim, dpmpp_2m, dpmpp_2m_karras, euler, "
        "euler_ancestral, unipc",
    ]
    with pytest.raises(ConfigError) as caught:
        impasto.build_config(raw)
    assert str(caught.value).splitlines() == expected
    assert main(["train", str(_write(tmp_path, raw)), "--print-config"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"impasto: error: {x}" for x in expected]


def test_family_method_and_preset_names_are_checked():
    raw = _raw(model={"family": "unet3", "preset": "huge"}, objective={"method": "dpo"})
    with pytest.raises(ConfigError) as caught:
        impasto.build_config(raw)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("model.family: unknown family 'unet3'; valid: ")
    assert "sdxl" in lines[0].split("valid: ")[1].split(", ")
    # an unknown family has no presets to check 'huge' against
    assert lines[1].startswith("objective.method: unknown method 'dpo'; valid: ")
    assert "denoise" in lines[1].split("valid: ")[1].split(", ")
    assert len(lines) == 2
    for family, valid in (("sdxl", "tiny, demo, sdxl"), ("dit", "tiny, s, b, l, xl, 7b, 28b")):
        raw = _raw(model={"family": family, "preset": "huge"})
        with pytest.raises(ConfigError) as caught:
            impasto.build_config(raw)
        assert str(caught.value).splitlines() == [
            f"model.preset: unknown preset 'huge' of family {family}; valid: {valid}"
        ]


def test_a_familys_options_and_parts_are_checked_by_the_family():
    raw = _raw(
        model={"family": "dit", "preset": "tiny", "dit": {"block": "unet", "patch": 2}},
        parts={"unet": "lora", "transformer_lr": 1e-4},
    )
    with pytest.raises(ConfigError) as caught:
        impasto.build_config(raw)
    assert str(caught.value).splitlines() == [
        "model.dit.block: Input should be 'adaln', 'cross' or 'llama', got 'unet'",
        "parts.unet: the dit family has no part 'unet'; its parts: transformer, text_encoder, "
        "text_encoder_2",
    ]
    raw = _raw(model={"preset": "tiny", "dit": {"block": "cross"}})
    with pytest.raises(ConfigError, match=r"model.dit: unknown key; a family's options sit "
                       r"under model.<family> \(model.family: sdxl\)"):  # fmt: skip
        impasto.build_config(raw)


def test_the_python_api_train_rejects_unknown_names(tmp_path):
    from impasto.train import train

    config = build_config(_raw(objective={"loss": "l3"}, train={"output_dir": str(tmp_path)}))
    with pytest.raises(ConfigError, match=r"^objective.loss: unknown name 'l3'; valid: huber"):
        train(config)
    assert not any(tmp_path.iterdir())  # refused before the run directory was touched
