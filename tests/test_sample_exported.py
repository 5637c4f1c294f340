"""``impasto sample`` opens exported models: a single file and a diffusers folder sample as the
run they came from (issue #17)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from impasto.cli import main
from impasto.config import build_config
from impasto.export import ExportOptions, export_checkpoint
from impasto.models.single_file.configs import CONFIGS_METADATA_KEY
from impasto.sample_source import open_model, scheduler_objective
from impasto.train.trainer import train

PROMPT = "a red circle on a white background"
FLAGS = ["--prompt", PROMPT, "--steps", "3", "--cfg", "3", "--seed", "1", "--size", "64"]
OBJECTIVES = {
    "epsilon": {},
    "vpred-ztsnr": {"prediction_type": "v_prediction", "zero_terminal_snr": True},
    "flow": {"prediction_type": "flow", "flow_shift": 3.0},
}


def _sample(model: Path | str, out: Path, *flags: str) -> np.ndarray:
    assert main(["sample", str(model), *flags, "--out", str(out)]) == 0
    (path,) = out.iterdir()
    with Image.open(path) as image:
        return np.asarray(image)


def _without_impasto_metadata(source: Path, target: Path) -> None:
    """The single file as another tool would write it: weights, ComfyUI's markers and the
    model spec, no ``impasto.*`` header but the architecture (the model is tiny, not SDXL's)."""
    with safe_open(source, framework="pt") as handle:
        metadata = handle.metadata()
    kept = {
        key: value
        for key, value in metadata.items()
        if not key.startswith("impasto.") or key == CONFIGS_METADATA_KEY
    }
    assert len(kept) < len(metadata)
    save_file(load_file(source), target, metadata=kept)


@pytest.mark.parametrize("kind", OBJECTIVES)
def test_exported_models_sample_as_their_run(kind, tiny_raw, tmp_path):
    tiny_raw["train"]["max_steps"] = 2
    tiny_raw["checkpoint"]["every_steps"] = 2
    tiny_raw["optim"]["lr"] = 1e-2  # weights that moved: a wrong load would show
    tiny_raw["objective"] = OBJECTIVES[kind]
    run = train(build_config(tiny_raw)).run_dir
    fp32 = ExportOptions(dtype="fp32")
    single = export_checkpoint(run, "single-file", tmp_path / "model.safetensors", fp32)
    folder = export_checkpoint(run, "diffusers", tmp_path / "diffusers", fp32)
    foreign = tmp_path / "foreign.safetensors"
    _without_impasto_metadata(single, foreign)

    expected = _sample(run, tmp_path / "from-run", *FLAGS)
    models = {"single": single, "diffusers": folder, "foreign": foreign}
    if kind == "flow":  # without impasto's header a single file does not say it is a flow model
        with pytest.raises(ValueError, match="modelspec.prediction_type 'flow'"):
            open_model(models.pop("foreign"))
    wanted = build_config(tiny_raw).objective
    for name, model in models.items():
        objective = open_model(model).objective
        for field in ("prediction_type", "zero_terminal_snr", "flow_shift", "schedule"):
            assert getattr(objective, field) == getattr(wanted, field), (name, field)
        assert np.array_equal(_sample(model, tmp_path / f"from-{name}", *FLAGS), expected), name
    # Without --size: the single file's modelspec.resolution, the diffusers UNet's sample size.
    assert _sample(single, tmp_path / "default-single", "--prompt", PROMPT).shape == (64, 64, 3)
    assert _sample(folder, tmp_path / "default-folder", "--prompt", PROMPT).shape == (64, 64, 3)


def test_an_exported_model_has_no_ema_and_no_base_to_anneal(tiny_raw, tmp_path, capsys):
    tiny_raw["train"]["max_steps"] = 1
    tiny_raw["checkpoint"]["every_steps"] = 1
    run = train(build_config(tiny_raw)).run_dir
    single = export_checkpoint(run, "single-file", tmp_path / "m.safetensors")
    out = str(tmp_path / "out")
    assert main(["sample", str(single), "--prompt", "x", "--ema", "--out", out]) == 2
    assert "is an exported model" in capsys.readouterr().err
    args = ["sample", str(single), "--prompt", "x", "--anneal", "linear", "--steps", "2"]
    assert main([*args, "--out", out]) == 2
    assert "does not name its base" in capsys.readouterr().err
    assert main(["sample", str(tmp_path / "nothing.bin"), "--prompt", "x", "--out", out]) == 2
    assert "nothing.bin: does not exist; check the path" in capsys.readouterr().err
    (tmp_path / "nothing.bin").write_bytes(b"\0" * 8)
    assert main(["sample", str(tmp_path / "nothing.bin"), "--prompt", "x", "--out", out]) == 2
    assert "a diffusers SDXL folder (model_index.json)" in capsys.readouterr().err


def test_scheduler_configs_give_the_objective_and_spacing(tmp_path):
    config = tmp_path / "scheduler_config.json"
    config.write_text(
        '{"_class_name": "EulerDiscreteScheduler", "prediction_type": "v_prediction", '
        '"rescale_betas_zero_snr": true, "timestep_spacing": "trailing", '
        '"beta_schedule": "squaredcos_cap_v2"}'
    )
    objective, spacing = scheduler_objective(config)
    assert (objective.prediction_type, objective.zero_terminal_snr) == ("v_prediction", True)
    assert (objective.schedule, spacing) == ("cosine", "trailing")
    config.write_text('{"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0}')
    objective, spacing = scheduler_objective(config)
    assert (objective.prediction_type, objective.flow_shift, spacing) == ("flow", 3.0, None)
    config.write_text('{"beta_schedule": "exponential"}')
    with pytest.raises(ValueError, match="beta_schedule 'exponential' is not one impasto"):
        scheduler_objective(config)
    config.write_text('{"prediction_type": "epsilon", "rescale_betas_zero_snr": true}')
    with pytest.raises(ValueError, match="cannot sample it as described"):
        scheduler_objective(config)  # zero terminal SNR needs v-prediction
    default, spacing = scheduler_objective(tmp_path / "missing.json")
    assert (default.prediction_type, default.schedule, spacing) == (
        "epsilon",
        "scaled_linear",
        None,
    )
