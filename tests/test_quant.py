"""``memory.frozen_dtype: float8 | int8`` (issue #33): the frozen base under LoRA adapters in one
byte per weight (torchao weight-only), on the tiny models of every family. It trains like the
fp32 base, holds fewer bytes (exactly the 1-byte data and per-row scales), a killed run resumes
bit for bit, checkpoints and exports hold the adapters alone in their own dtype, and
``impasto bench --estimate`` counts the quantized bytes."""

from __future__ import annotations

import copy
import importlib.util
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same
from reliability.harness import final_state, run, write_config
from safetensors import safe_open
from torch import nn

from impasto.checkpoint import latest_checkpoint, load_checkpoint
from impasto.config import build_config
from impasto.data.pipeline import prepare_run_data
from impasto.precision import resolve_precision
from impasto.train.quantize import tensor_bytes
from impasto.train.setup import StepSetup, build_step_setup

CPU = torch.device("cpu")
FLUX = {"family": "flux", "preset": "tiny", "flux": {"text_length": 16}}
FAMILIES: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "sdxl": ({"preset": "tiny"}, {}, "unet"),
    "flux": (FLUX, {"prediction_type": "flow", "timestep_sampling": "logit_normal"}, "transformer"),
}
HALF_STEP = {"float8": 16 / 448, "int8": 0.5 / 127}
LOSS_TOLERANCE = {"sdxl": 2e-3, "flux": 2e-3, "dit": 2e-2}
# Bytes a quantized weight of shape (rows, columns) holds: 1-byte data and a float32 scale per
# row (int8 adds an int8 zero point per row, always 0: symmetric).
PER_ROW = {"float8": 4, "int8": 5}


@pytest.fixture(scope="module")
def perturbed_dit_folder(tmp_path_factory) -> Path:
    """The DiT family's tiny preset with every weight moved off its zero start (as a trained
    model has them: a fresh one zero-initialises its output and modulation layers, so nothing
    before them would learn), saved as a model folder."""
    from impasto.models import build_backbone
    from impasto.models.dit.files import save_dit_folder

    raw = {"model": {"family": "dit", "preset": "tiny"}, "data": {"path": "unused"},
           "train": {"max_steps": 1}}  # fmt: skip
    backbone = build_backbone(build_config(raw))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in backbone.denoiser().parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    record = {"family": "dit", "objective": {"prediction_type": "flow"}, "resolution": 64}
    out = tmp_path_factory.mktemp("dit") / "model"
    return save_dit_folder(backbone, out, record, torch.float32)


def lora_raw(family: str, data: Path, out: Path, frozen_dtype: str, **train: Any) -> dict:
    model, objective, part = FAMILIES[family]
    return {
        "model": copy.deepcopy(model),
        "objective": objective,
        "data": {"path": str(data), "resolution": 64, "batch_size": 2},
        "parts": {part: "lora"},
        "lora": {"rank": 4},
        "optim": {"lr": 1e-2, "weight_decay": 0.0},
        "memory": {"frozen_dtype": frozen_dtype},
        "train": {"output_dir": str(out), "seed": 0, "max_steps": 4, **train},
        "checkpoint": {"every_steps": 2, "keep_last": 2},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }


def fixed_batch_losses(raw: dict, steps: int = 6) -> tuple[list[float], StepSetup]:
    """Train the adapters ``steps`` times on one batch with the same noise and timesteps:
    each step's loss (before its update), and the step setup."""
    config = build_config(raw)
    precision = resolve_precision(config.train.mixed_precision, CPU)
    setup = build_step_setup(config, CPU, precision)
    data = prepare_run_data(config, setup.backbone, None, True, setup.autocast, str(precision))
    batch = next(data.stream)
    losses = []
    for _ in range(steps):
        torch.manual_seed(0)
        out = setup.micro_step(batch, torch.Generator().manual_seed(0))
        setup.update(None)
        losses.append(out.loss.item())
    return losses, setup


def frozen_linears(setup: StepSetup) -> dict[str, nn.Linear]:
    part = next(iter(setup.trainable.values()))
    return {
        name: module
        for name, module in part.module.named_modules()
        if type(module) is nn.Linear and not module.weight.requires_grad
    }


@pytest.mark.parametrize("family", [*FAMILIES, "dit"])
def test_a_quantized_base_trains_like_the_fp32_base_in_fewer_bytes(
    family, demo_folder, tmp_path, request
):
    def raw_of(frozen_dtype: str) -> dict:
        if family in FAMILIES:
            return lora_raw(family, demo_folder, tmp_path, frozen_dtype)
        raw = lora_raw("flux", demo_folder, tmp_path, frozen_dtype)  # the same part name
        folder = request.getfixturevalue("perturbed_dit_folder")
        raw["model"] = {"family": "dit", "path": str(folder)}
        raw["objective"] = {"prediction_type": "flow"}
        return raw

    reference, plain = fixed_batch_losses(raw_of("fp32"))
    plain_linears = frozen_linears(plain)
    plain_bytes = sum(tensor_bytes(m.weight) for m in plain_linears.values())
    assert reference[-1] < reference[0] - 1e-2  # the adapters learn the batch
    for frozen_dtype in ("float8", "int8"):
        losses, setup = fixed_batch_losses(raw_of(frozen_dtype))
        # Rounding the base to 1 byte moves each loss a little (measured: <= 0.13 % on the
        # tiny SDXL and FLUX, 1.3 % with float8 on the perturbed DiT, whose weights
        # e4m3's 3 mantissa bits round the most); the adapters learn as much over the steps
        # (measured: the loss falls by the fp32 base's fall within 3.4 %).
        assert losses == pytest.approx(reference, rel=LOSS_TOLERANCE[family]), frozen_dtype
        fall = losses[0] - losses[-1]
        assert fall == pytest.approx(reference[0] - reference[-1], rel=5e-2), frozen_dtype
        linears = frozen_linears(setup)
        assert linears.keys() == plain_linears.keys() and len(linears) > 10
        for name, layer in linears.items():
            rows, columns = plain_linears[name].weight.shape
            assert type(layer.weight).__name__ != "Parameter", name
            assert tensor_bytes(layer.weight) == rows * (columns + PER_ROW[frozen_dtype]), name
            # The starting weights to within half a step of the row's scale: float8 e4m3
            # steps by 32 just under its max 448 (16/448 of the row's max |w|), int8 by 1/127.
            weight = plain_linears[name].weight.detach()
            error = (layer.weight.dequantize() - weight).abs().amax(dim=1)
            bound = weight.abs().amax(dim=1) * HALF_STEP[frozen_dtype] * (1 + 1e-6)
            assert bool((error <= bound).all()), name
        quantized = sum(tensor_bytes(m.weight) for m in linears.values())
        assert quantized < 0.3 * plain_bytes, (quantized, plain_bytes)
        for param in setup.params:  # the adapters: fp32 and trainable, a plain tensor
            assert type(param) is nn.Parameter and param.dtype == torch.float32


def test_float8_leaves_a_layer_with_a_zero_row_unquantized(tmp_path, demo_folder):
    """float8's per-row scale is max|w| / 448: a zero row would be 0/0. A model trained from
    scratch zero-initialises its modulation and output layers (the DiT family's tiny preset):
    those keep fp32 and the loss stays finite and equal to the fp32 base's."""
    raw = lora_raw("flux", demo_folder, tmp_path, "float8")
    raw["model"] = {"family": "dit", "preset": "tiny"}
    raw["objective"] = {"prediction_type": "flow"}
    losses, setup = fixed_batch_losses(raw, steps=2)
    reference, _ = fixed_batch_losses({**raw, "memory": {"frozen_dtype": "fp32"}}, steps=2)
    assert losses == reference and all(loss == loss for loss in losses)  # finite, not NaN
    kept = [layer for layer in frozen_linears(setup).values() if type(layer.weight) is nn.Parameter]
    assert kept and all(bool((layer.weight.abs().amax(dim=1) == 0).any()) for layer in kept)
    assert len(kept) < len(frozen_linears(setup))


def test_under_bf16_autocast_the_base_dequantizes_to_bf16_and_the_rest_is_bf16(
    demo_folder, tmp_path
):
    raw = lora_raw("sdxl", demo_folder, tmp_path, "float8", mixed_precision="bf16")
    raw["parts"]["text_encoder"] = "lora"
    reference, _ = fixed_batch_losses({**raw, "memory": {"frozen_dtype": "bf16"}}, steps=3)
    losses, setup = fixed_batch_losses(raw, steps=3)
    assert losses == pytest.approx(reference, rel=2e-3)
    components = setup.backbone.components
    for name, module in frozen_linears(setup).items():
        assert module.weight.dtype == torch.bfloat16, name  # what dequantize() returns
    frozen = [p for p in components.text_encoder_2.parameters()]  # not trained: bf16
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    assert all(p.dtype == torch.float32 for p in setup.params)


def test_what_cannot_apply_is_one_line_naming_the_fix(demo_folder, tmp_path, monkeypatch):
    from impasto.train.quantize import check_quantized_base

    raw = lora_raw("sdxl", demo_folder, tmp_path, "int8")
    full = {**raw, "parts": {"unet": "full"}}
    with pytest.raises(ValueError, match=r"but parts.unet trains in full; set parts.<part>: lora"):
        build_step_setup(build_config(full), CPU, None)
    ddp = {**raw, "parallel": {"strategy": "ddp"}}
    with pytest.raises(ValueError, match="parallel.strategy ddp .* train on one device"):
        build_step_setup(build_config(ddp), CPU, None)
    compiled = {**raw, "memory": {"frozen_dtype": "int8", "compile": "blocks"}}
    with pytest.raises(ValueError, match="memory.compile blocks fails .* set memory.compile: none"):
        build_step_setup(build_config(compiled), CPU, None)
    offload = {**raw, "memory": {"frozen_dtype": "float8", "offload_blocks": True}}
    with pytest.raises(ValueError, match="on cuda; set memory.offload_blocks: false"):
        check_quantized_base(build_config(offload), torch.device("cuda"))
    check_quantized_base(build_config(offload), CPU)  # the CPU stand-in offloads
    with pytest.raises(ValueError, match="memory.frozen_dtype"):
        build_config({**raw, "memory": {"frozen_dtype": "int4"}})
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name)
    )
    with pytest.raises(ValueError, match=r'not installed; pip install "impasto\[quant\]"'):
        build_step_setup(build_config(raw), CPU, None)


def test_a_quantized_base_offloaded_trains_as_resident(demo_folder, tmp_path):
    """Block offload (its CPU stand-in) streams the quantized weights like any other."""
    raw = lora_raw("sdxl", demo_folder, tmp_path, "int8")
    resident, _ = fixed_batch_losses(raw, steps=3)
    raw["memory"]["offload_blocks"] = True
    offloaded, setup = fixed_batch_losses(raw, steps=3)
    assert setup.offload is not None
    assert offloaded == resident


def test_the_estimate_counts_the_quantized_base_as_a_real_build_holds_it(demo_folder, tmp_path):
    from impasto.bench import run_bench

    sets = ["parts.transformer=lora", "memory.frozen_dtype=float8"]
    report = run_bench("flux-tiny", resolution=64, estimate=True, overrides=sets, device="cpu")
    _, setup = fixed_batch_losses(lora_raw("flux", demo_folder, tmp_path, "float8"), steps=1)
    transformer = setup.backbone.components.transformer
    trained = {id(p) for p in setup.params}
    real = sum(tensor_bytes(p) for p in transformer.parameters() if id(p) not in trained)
    assert report["frozen_gib"]["transformer"] * 2**30 == pytest.approx(real, abs=0.5)
    plain = run_bench("flux-tiny", resolution=64, estimate=True, overrides=sets[:1], device="cpu")
    saved = plain["frozen_gib"]["transformer"] - report["frozen_gib"]["transformer"]
    # 3 of each fp32 weight's 4 bytes, less a 4-byte scale per row
    linears = frozen_linears(setup).values()
    expected = sum(3 * m.weight.numel() - 4 * m.weight.shape[0] for m in linears)
    assert saved * 2**30 == pytest.approx(expected, abs=0.5)
    assert report["frozen_dtype"] == "float8"
    variant = run_bench("flux-tiny", resolution=64, estimate=True, overrides=sets[:1],
                        variants=("float8",), device="cpu")  # fmt: skip
    assert variant["memory_variant"] == "float8" and variant["frozen_gib"] == report["frozen_gib"]


def test_a_stopped_int8_base_run_resumes_bitwise_in_process(demo_folder, tmp_path):
    """The fast form of the kill test below (the slow set runs that one): a run stopped at
    its step-2 checkpoint and resumed equals the uninterrupted run bit for bit."""
    from impasto.train.trainer import train

    def raw(run_dir: Path, max_steps: int) -> dict:
        settings = lora_raw("sdxl", demo_folder, run_dir, "int8", max_steps=max_steps)
        settings["lora"]["dropout"] = 0.1
        return settings

    straight = train(build_config(raw(tmp_path / "straight", 4)))
    train(build_config(raw(tmp_path / "resumed", 2)))
    resumed = train(build_config(raw(tmp_path / "resumed", 4)))
    a, b = load_checkpoint(straight.last_checkpoint), load_checkpoint(resumed.last_checkpoint)
    assert set(a.tensors) == {"unet"} and all("lora_" in key for key in a.tensors["unet"])
    assert_same(a.tensors, b.tensors, "weights")
    assert_same(a.objects, b.objects, "optimizer and rng")


@pytest.mark.slow  # three runs of a child process (20 to 40 s)
def test_a_killed_quantized_base_run_resumes_bitwise_and_saves_only_adapters(demo_folder, tmp_path):
    """The acceptance of issue #33: kill -9 mid-run (tests/reliability's harness) and run the
    same command again: the final state equals the uninterrupted run's bit for bit."""
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    configs = {}
    for run_dir in (straight_dir, resumed_dir):
        raw = lora_raw("flux", demo_folder, run_dir, "float8", max_steps=6)
        raw["lora"]["dropout"] = 0.1  # randomness from the global generator too
        configs[run_dir] = write_config(tmp_path / f"{run_dir.name}.yaml", raw)
    assert run(configs[straight_dir]).returncode == 0
    killed = run(configs[resumed_dir], fault="step:4")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert int(latest_checkpoint(resumed_dir / "checkpoints").name.removeprefix("step-")) == 2
    finished = run(configs[resumed_dir])
    assert finished.returncode == 0, finished.stderr
    assert "resumed from" in finished.stdout
    assert_same(final_state(straight_dir), final_state(resumed_dir), "final state")
    saved = load_checkpoint(latest_checkpoint(resumed_dir / "checkpoints")).tensors
    assert set(saved) == {"transformer"}
    assert saved["transformer"] and all("lora_" in key for key in saved["transformer"])
    assert {t.dtype for t in saved["transformer"].values()} == {torch.float32}


def test_the_lora_export_is_the_same_as_from_an_fp32_base(demo_folder, tmp_path):
    """Exports rebuild the model at full precision and load the adapters: the same keys,
    shapes and dtype (the adapters' own, fp32) as a run on the fp32 base, and the values are
    the checkpoint's adapters exactly."""
    from impasto.export import ExportOptions, export_checkpoint
    from impasto.train.trainer import train

    files, adapters = {}, {}
    for frozen_dtype in ("fp32", "float8"):
        run_dir = tmp_path / frozen_dtype
        train(build_config(lora_raw("sdxl", demo_folder, run_dir, frozen_dtype, max_steps=2)))
        out = export_checkpoint(
            run_dir, "lora-kohya", tmp_path / f"{frozen_dtype}.safetensors", ExportOptions("fp32")
        )
        with safe_open(str(out), "pt") as file:
            files[frozen_dtype] = {key: file.get_tensor(key) for key in file.keys()}
        checkpoint = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
        adapters[frozen_dtype] = list(checkpoint.tensors["unet"].values())
    plain, quantized = files["fp32"], files["float8"]
    assert plain.keys() == quantized.keys() and len(plain) > 10
    trained = adapters["float8"]
    for key, tensor in quantized.items():
        assert tensor.dtype == plain[key].dtype == torch.float32, key
        assert tensor.shape == plain[key].shape, key
        if "lora_down" in key or "lora_up" in key:  # kohya's names of lora_A, lora_B
            assert any(
                t.numel() == tensor.numel() and torch.equal(t.reshape(tensor.shape), tensor)
                for t in trained
            ), key
    assert any(not torch.equal(quantized[k], plain[k]) for k in plain)  # a different base
