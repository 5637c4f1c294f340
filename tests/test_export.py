"""``impasto export`` (issue #5): checkpoints in the formats diffusers and other tools load."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusionXLPipeline
from peft import get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file
from tiny_inputs import tiny_unet_output

from impasto.checkpoint.trained import load_trained
from impasto.cli import main
from impasto.config import build_config
from impasto.export import (
    EXPORTERS,
    ExportOptions,
    export_checkpoint,
    exporter_for,
    merge_adapters,
    register_exporter,
)
from impasto.models.io import to_pipeline
from impasto.models.lora_kohya import from_kohya
from impasto.models.presets import build_tiny
from impasto.models.single_file import load_single_file, sgm_state_dict
from impasto.train.trainer import Trainer, train


def _run(tiny_raw, tmp_path, name, **sections):
    tiny_raw["train"] = {**tiny_raw["train"], "max_steps": 2, "output_dir": str(tmp_path / name)}
    tiny_raw["checkpoint"]["every_steps"] = 2
    tiny_raw["optim"]["lr"] = 1e-2
    for section, values in sections.items():
        tiny_raw[section] = values
    return train(build_config(tiny_raw)).run_dir


def _prompt_embeds(pipe) -> torch.Tensor:
    with torch.no_grad():
        return pipe.encode_prompt("a red circle", do_classifier_free_guidance=False)[0]


def test_diffusers_export_loads_in_diffusers_with_a_matching_scheduler(tiny_raw, tmp_path):
    objective = {"prediction_type": "v_prediction", "zero_terminal_snr": True}
    run = _run(tiny_raw, tmp_path, "vpred", objective=objective)
    out = tmp_path / "exported"
    assert (
        main(["export", str(run), "--format", "diffusers", "--out", str(out), "--dtype", "fp32"])
        == 0
    )
    pipe = StableDiffusionXLPipeline.from_pretrained(out)
    _, trained = load_trained(run)
    trained = trained.components
    for name, tensor in trained.unet.state_dict().items():
        assert torch.equal(pipe.unet.state_dict()[name], tensor), name
    scheduler = pipe.scheduler.config
    assert scheduler.prediction_type == "v_prediction" and scheduler.rescale_betas_zero_snr
    assert scheduler.timestep_spacing == "trailing"

    half = tmp_path / "half"
    assert main(["export", str(run), "--format", "diffusers", "--out", str(half)]) == 0
    weights = load_file(half / "unet" / "diffusion_pytorch_model.safetensors")
    assert {tensor.dtype for tensor in weights.values()} == {torch.float16}


def test_flow_export_ships_a_flow_match_scheduler(tiny_raw, tmp_path):
    objective = {"prediction_type": "flow", "flow_shift": 3.0}
    run = _run(tiny_raw, tmp_path, "flow", objective=objective)
    out = tmp_path / "flow-export"
    assert main(["export", str(run), "--format", "diffusers", "--out", str(out)]) == 0
    scheduler = StableDiffusionXLPipeline.from_pretrained(out).scheduler
    assert isinstance(scheduler, FlowMatchEulerDiscreteScheduler)
    assert scheduler.config.shift == 3.0


def test_lora_exports_load_in_diffusers_and_merge_exactly(tiny_raw, tmp_path, capsys):
    parts = {"unet": "lora", "text_encoder_2": "lora"}
    run = _run(tiny_raw, tmp_path, "lora", parts=parts, lora={"rank": 4})
    _, trained = load_trained(run)
    trained = trained.components
    base = to_pipeline(build_tiny(0))
    assert not torch.allclose(tiny_unet_output(trained.unet), tiny_unet_output(base.unet))

    # diffusers/peft format: a fresh base pipeline + load_lora_weights equals the trained model.
    lora_dir = tmp_path / "lora"
    assert (
        main(
            [
                "export",
                str(run),
                "--format",
                "lora-diffusers",
                "--out",
                str(lora_dir),
                "--dtype",
                "fp32",
            ]
        )
        == 0
    )
    base.load_lora_weights(lora_dir)
    torch.testing.assert_close(tiny_unet_output(base.unet), tiny_unet_output(trained.unet))
    torch.testing.assert_close(_prompt_embeds(base), _prompt_embeds(to_pipeline(trained)))

    # A full-model export of a LoRA run needs --merge, then equals the adapted model.
    merged = tmp_path / "merged"
    code = main(["export", str(run), "--format", "diffusers", "--out", str(merged)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "add --merge" in err, err
    args = ["export", str(run), "--format", "diffusers", "--out", str(merged), "--dtype", "fp32"]
    assert main([*args, "--merge"]) == 0
    pipe = StableDiffusionXLPipeline.from_pretrained(merged)
    torch.testing.assert_close(
        tiny_unet_output(pipe.unet), tiny_unet_output(trained.unet), rtol=1e-5, atol=1e-5
    )
    assert not any("lora" in key for key in pipe.unet.state_dict())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "ckpt"], "unknown format 'ckpt'"),
        (["--format", "diffusers", "--dtype", "fp8"], "unknown dtype 'fp8'"),
        (["--format", "lora-diffusers"], "trained no adapters"),
    ],
)
def test_bad_exports_are_one_line_errors(tiny_raw, tmp_path, capsys, args, message):
    run = _run(tiny_raw, tmp_path, "full")
    code = main(["export", str(run), "--out", str(tmp_path / "x"), *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err


def test_exporters_are_registered_per_family():
    assert set(EXPORTERS["sdxl"]) == {"single-file", "diffusers", "lora-kohya", "lora-diffusers"}
    assert exporter_for("sdxl", "lora-kohya") is EXPORTERS["sdxl"]["lora-kohya"]
    with pytest.raises(ValueError) as error:
        exporter_for("sdxl", "ckpt")
    message = str(error.value)
    assert "\n" not in message and "unknown format 'ckpt' for model.family 'sdxl'" in message
    assert message.endswith("valid: diffusers, single-file, lora-diffusers, lora-kohya")
    with pytest.raises(ValueError, match="model.family 'toy', which has no export formats"):
        exporter_for("toy", "diffusers")
    with pytest.raises(ValueError, match="sdxl export format 'diffusers' is registered twice"):
        register_exporter("sdxl", "diffusers")(lambda checkpoint, out, options: out)


def test_single_file_export_loads_back_with_comfyui_markers_and_trains(tiny_raw, tmp_path):
    objective = {"prediction_type": "v_prediction", "zero_terminal_snr": True}
    run = _run(tiny_raw, tmp_path, "vpred", objective=objective)
    out = tmp_path / "model.safetensors"
    args = ["export", str(run), "--format", "single-file", "--out", str(out), "--dtype", "fp32"]
    assert main(args) == 0
    with safe_open(out, framework="pt") as handle:
        keys, metadata = set(handle.keys()), handle.metadata()
    assert {"v_pred", "ztsnr"} <= keys  # what ComfyUI reads to sample v-prediction / ZTSNR
    assert metadata["modelspec.prediction_type"] == "v"
    assert metadata["modelspec.architecture"] == "stable-diffusion-xl-v1-base"
    assert metadata["impasto.zero_terminal_snr"] == "true"
    loaded = load_single_file(out)
    _, trained = load_trained(run)
    trained = trained.components
    for name, tensor in trained.unet.state_dict().items():
        assert torch.equal(loaded.unet.state_dict()[name], tensor), name
    # model.path may name the single file: a run continues from it.
    tiny_raw["model"] = {"path": str(out)}
    again = _run(tiny_raw, tmp_path, "from-single-file", objective=objective)
    assert (again / "checkpoints" / "step-00000002").is_dir()


def _kohya_to_original(state: dict[str, torch.Tensor], prefix: str, lora_prefix: str) -> dict:
    """kohya entry name → original weight key, by kohya's rule (dots to underscores)."""
    return {
        lora_prefix + key[len(prefix) : -len(".weight")].replace(".", "_"): key
        for key in state
        if key.startswith(prefix) and key.endswith(".weight")
    }


def test_kohya_lora_applied_independently_equals_the_merged_model(tiny_raw, tmp_path):
    parts = {"unet": "lora", "text_encoder": "lora", "text_encoder_2": "lora"}
    run = _run(tiny_raw, tmp_path, "lora", parts=parts, lora={"rank": 4, "alpha": 2.0})
    out = tmp_path / "lora.safetensors"
    args = ["export", str(run), "--format", "lora-kohya", "--out", str(out), "--dtype", "fp32"]
    assert main(args) == 0
    kohya = load_file(out)
    assert {key.split("_", 2)[1] for key in kohya} == {"unet", "te1", "te2"}
    assert any(key.startswith("lora_unet_input_blocks_") for key in kohya)  # SGM block names

    # Apply W + up·down·alpha/rank to the base weights, by name alone (no peft, no impasto map).
    base = build_tiny(0)
    original = sgm_state_dict(base)
    te2 = {
        f"text_model.{k}" if not k.startswith("text_model.") else k: v
        for k, v in base.text_encoder_2.state_dict().items()
    }
    targets = {
        **{
            k: ("sgm", v)
            for k, v in _kohya_to_original(original, "model.diffusion_model.", "lora_unet_").items()
        },
        **{
            k: ("sgm", v)
            for k, v in _kohya_to_original(
                original, "conditioner.embedders.0.transformer.", "lora_te1_"
            ).items()
        },
        **{k: ("te2", v) for k, v in _kohya_to_original(te2, "", "lora_te2_").items()},
    }
    applied = {"sgm": dict(original), "te2": dict(te2)}
    names = {key.rsplit(".", 2)[0] for key in kohya if key.endswith("lora_down.weight")}
    for name in names:
        down, up = kohya[f"{name}.lora_down.weight"], kohya[f"{name}.lora_up.weight"]
        scale = kohya[f"{name}.alpha"].item() / down.shape[0]
        where, key = targets[name]
        applied[where][key] = applied[where][key] + up @ down * scale
    assert len(names) == len(kohya) // 3

    _, merged = load_trained(run)

    merged = merged.components
    for part in parts:
        merge_adapters(getattr(merged, part))
    expected = sgm_state_dict(merged)
    for key in original:  # UNet, VAE, CLIP-L; CLIP-G (packed in_proj there) is checked below
        if not key.startswith("conditioner.embedders.1."):
            torch.testing.assert_close(applied["sgm"][key], expected[key], rtol=1e-5, atol=1e-6)
    merged_te2 = {
        f"text_model.{k}" if not k.startswith("text_model.") else k: v
        for k, v in merged.text_encoder_2.state_dict().items()
    }
    for key in te2:
        torch.testing.assert_close(applied["te2"][key], merged_te2[key], rtol=1e-5, atol=1e-6)

    # diffusers' own kohya-format loader (SGM block names mapped by diffusers) agrees exactly.
    pipe = to_pipeline(build_tiny(0))
    pipe.load_lora_weights(out)
    torch.testing.assert_close(tiny_unet_output(pipe.unet), tiny_unet_output(merged.unet))
    torch.testing.assert_close(_prompt_embeds(pipe), _prompt_embeds(to_pipeline(merged)))


def test_kohya_round_trip_is_bit_exact(tiny_raw, tmp_path):
    parts = {"unet": "lora", "text_encoder": "lora"}
    run = _run(tiny_raw, tmp_path, "lora", parts=parts, lora={"rank": 4})
    config, trained = load_trained(run)
    trained = trained.components
    out = tmp_path / "lora.safetensors"
    assert (
        main(["export", str(run), "--format", "lora-kohya", "--out", str(out), "--dtype", "fp32"])
        == 0
    )
    modules = {part: getattr(trained, part) for part in parts}
    states = from_kohya(modules, load_file(out), rank=4, alpha=4.0)
    for part, module in modules.items():
        original = get_peft_model_state_dict(module)
        assert states[part].keys() == original.keys()
        for key, tensor in original.items():
            assert torch.equal(states[part][key], tensor), key
    with pytest.raises(ValueError, match="rank 4, the config's lora.rank is 8"):
        from_kohya(modules, load_file(out), rank=8, alpha=4.0)


def test_a_run_starts_from_a_kohya_lora(tiny_raw, tmp_path, capsys):
    run = _run(tiny_raw, tmp_path, "lora", parts={"unet": "lora"}, lora={"rank": 4})
    out = tmp_path / "lora.safetensors"
    assert (
        main(["export", str(run), "--format", "lora-kohya", "--out", str(out), "--dtype", "fp32"])
        == 0
    )
    _, trained = load_trained(run)
    trained = trained.components
    tiny_raw["lora"] = {"rank": 4, "init_from": str(out)}
    tiny_raw["train"]["output_dir"] = str(tmp_path / "continued")
    trainer = Trainer(build_config(tiny_raw), resume=False)
    expected = get_peft_model_state_dict(trained.unet)
    started = get_peft_model_state_dict(trainer.setup.backbone.components.unet)
    assert expected.keys() == started.keys()
    assert all(torch.equal(started[key], expected[key]) for key in expected)
    assert f"started {len(expected) // 2} LoRA layers" in capsys.readouterr().out
    trainer.close()  # hands back the run directory (a live trainer holds its lock)
    tiny_raw["lora"] = {"rank": 8, "init_from": str(out)}
    with pytest.raises(
        ValueError, match="lora.init_from .*lora.safetensors: lora: .*lora.alpha is 8"
    ):
        Trainer(build_config(tiny_raw), resume=False)


def test_merge_lora_adds_a_kohya_lora_to_another_model(tiny_raw, tmp_path):
    parts = {"unet": "lora", "text_encoder": "lora", "text_encoder_2": "lora"}
    lora_run = _run(tiny_raw, tmp_path, "lora", parts=parts, lora={"rank": 4, "alpha": 8.0})
    lora_file = tmp_path / "lora.safetensors"
    args = ["--dtype", "fp32"]
    assert (
        main(["export", str(lora_run), "--format", "lora-kohya", "--out", str(lora_file), *args])
        == 0
    )
    _, adapted = load_trained(lora_run)
    adapted = adapted.components
    for part in parts:
        merge_adapters(getattr(adapted, part))
    base = build_tiny(0)

    full_run = _run(tiny_raw, tmp_path, "full", parts={"unet": "full"}, lora={})
    out = tmp_path / "merged"
    merge = ["--merge-lora", str(lora_file), "--lora-scale", "0.5"]
    assert (
        main(["export", str(full_run), "--format", "diffusers", "--out", str(out), *args, *merge])
        == 0
    )
    exported = StableDiffusionXLPipeline.from_pretrained(out)
    _, full = load_trained(full_run)
    full = full.components
    # The LoRA's delta does not depend on the base: exported − full = ½·(adapted − base).
    for part in parts:
        before, lora_delta = getattr(full, part).state_dict(), getattr(adapted, part).state_dict()
        base_state = getattr(base, part).state_dict()
        for key, tensor in getattr(exported, part).state_dict().items():
            expected = before[key] + 0.5 * (lora_delta[key] - base_state[key])
            torch.testing.assert_close(tensor, expected, rtol=1e-5, atol=1e-6, msg=f"{part} {key}")


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_exports_and_checkpoints_follow_the_umask(tiny_raw, tmp_path, umask):
    """safetensors creates 0600 files; impasto's files get what the umask says (0644 / 0600)."""
    previous = os.umask(umask)
    try:
        run = _run(tiny_raw, tmp_path, "lora", parts={"unet": "lora"}, lora={"rank": 4})
        lora = export_checkpoint(run, "lora-kohya", tmp_path / "lora.safetensors")
        folder = export_checkpoint(run, "lora-diffusers", tmp_path / "pipe", ExportOptions("fp32"))
    finally:
        os.umask(previous)
    checkpoint = run / "checkpoints" / "step-00000002"
    files = [lora, *checkpoint.iterdir(), *(p for p in folder.rglob("*") if p.is_file())]
    assert {stat.S_IMODE(path.stat().st_mode) for path in files} == {0o666 & ~umask}
    assert stat.S_IMODE(checkpoint.stat().st_mode) == 0o777 & ~umask
