"""Memory and speed options change how the step runs, not what it computes: fused backward,
per-block gradient checkpointing, SDPA kernel choice, channels-last, regional compile."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from impasto.config import build_config
from impasto.models.presets import build_tiny
from impasto.models.sdxl import unet_blocks
from impasto.train.fused import FusedBackwardOptimizer
from impasto.train.memory import (
    attention_context,
    compile_denoiser,
    set_gradient_checkpointing,
)
from impasto.train.optim import OPTIMIZERS
from impasto.train.trainer import train


def unet_loss(unet, seed: int = 5) -> torch.Tensor:
    """An SDXL-shaped call of the tiny UNet and an MSE loss against a fixed target."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 8, 8, generator=generator)
    context = torch.randn(2, 77, 64, generator=generator)
    added = {"text_embeds": torch.randn(2, 32, generator=generator), "time_ids": torch.ones(2, 6)}
    target = torch.randn(2, 4, 8, 8, generator=generator)
    out = unet(x, torch.tensor([500, 20]), context, added_cond_kwargs=added).sample
    return torch.nn.functional.mse_loss(out, target)


def loss_and_grads(unet) -> tuple[float, dict[str, torch.Tensor]]:
    unet.zero_grad(set_to_none=True)
    loss = unet_loss(unet)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in unet.named_parameters()}


def assert_same(a: tuple, b: tuple, atol: float = 0.0) -> None:
    assert a[0] == pytest.approx(b[0], abs=atol, rel=0)
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=0, atol=atol, msg=name)


def test_fused_backward_equals_the_unfused_step() -> None:
    reference, fused = build_tiny(0).unet, build_tiny(0).unet
    config = build_config(
        {"model": {"preset": "tiny"}, "data": {"path": "x"}, "train": {"max_steps": 1}}
    ).optim
    plain = OPTIMIZERS["adamw"](reference.parameters(), config)
    hooked = FusedBackwardOptimizer(
        [{"params": list(fused.parameters()), "lr": 1e-3}],
        lambda groups: OPTIMIZERS["adamw"](groups, config),
    )
    for group in plain.param_groups:
        group["lr"] = 1e-3
    for step in range(3):
        unet_loss(reference, seed=step).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), math.inf).item()
        plain.step()
        plain.zero_grad(set_to_none=True)
        unet_loss(fused, seed=step).backward()
        fused_norm, nonfinite = hooked.finish_step()
        assert nonfinite == 0 and fused_norm == pytest.approx(norm, rel=1e-5)
        assert all(p.grad is None for p in fused.parameters())  # freed inside backward
    for (name, a), b in zip(reference.named_parameters(), fused.parameters(), strict=True):
        assert torch.equal(a, b), name
    state = hooked.state_dict()
    again = FusedBackwardOptimizer(
        [{"params": list(build_tiny(0).unet.parameters()), "lr": 1e-3}],
        lambda groups: OPTIMIZERS["adamw"](groups, config),
    )
    again.load_state_dict(state)
    assert again.optimizers[3].state_dict()["state"][0]["step"] == 3
    with pytest.raises(ValueError, match="same memory.fused_backward setting"):
        again.load_state_dict(plain.state_dict())


def test_fused_backward_zeroes_and_counts_a_non_finite_gradient() -> None:
    unet = build_tiny(0).unet
    weight = unet.conv_in.weight
    before = weight.detach().clone()
    hooked = FusedBackwardOptimizer(
        [{"params": [weight], "lr": 1e-3}],
        lambda groups: torch.optim.SGD(groups, lr=1e-3),
    )
    (unet_loss(unet) * weight.sum() * float("inf")).backward()
    norm, nonfinite = hooked.finish_step()
    assert nonfinite == 1 and norm == 0.0
    assert torch.equal(weight.detach(), before)  # SGD with a zero gradient: unchanged


def test_a_fused_run_trains_like_an_unfused_one(tmp_path, demo_folder) -> None:
    raw = {
        "model": {"preset": "tiny"},
        "data": {"path": str(demo_folder), "resolution": 64, "batch_size": 2},
        "optim": {"lr": 1e-3, "max_grad_norm": None},
        "train": {"output_dir": str(tmp_path / "plain"), "max_steps": 3, "seed": 1},
        "log": {"tensorboard": False, "progress_bar": False},
    }
    fused = copy.deepcopy(raw)
    fused["memory"] = {"fused_backward": True}
    fused["train"]["output_dir"] = str(tmp_path / "fused")
    runs = [train(build_config(settings)).run_dir for settings in (raw, fused)]
    a, b = (load_file(run / "checkpoints/step-00000003/unet.safetensors") for run in runs)
    assert all(torch.equal(a[name], b[name]) for name in a)
    fused["train"]["grad_accum_steps"] = 2
    with pytest.raises(ValueError, match="set train.grad_accum_steps: 1"):
        build_config(fused)
    fused["train"]["grad_accum_steps"] = 1
    fused["optim"]["max_grad_norm"] = 1.0
    with pytest.raises(ValueError, match="set optim.max_grad_norm: null"):
        build_config(fused)


def test_gradient_checkpointing_of_chosen_blocks_keeps_loss_and_gradients() -> None:
    reference = loss_and_grads(build_tiny(0).unet)
    unet = build_tiny(0).unet
    assert set_gradient_checkpointing(unet, unet_blocks(unet), ["down.1", "up.0"]) == [
        "down.1",
        "up.0",
    ]
    flags = {name: block.gradient_checkpointing for name, block in unet_blocks(unet).items()}
    assert flags == {"down.0": False, "down.1": True, "mid": False, "up.0": True, "up.1": False}
    assert_same(loss_and_grads(unet), reference)
    with pytest.raises(ValueError, match="no block 'up.7'; its blocks: down.0, down.1, mid"):
        set_gradient_checkpointing(unet, unet_blocks(unet), ["up.7"])
    everything = build_tiny(0).unet
    set_gradient_checkpointing(everything, unet_blocks(everything), "all")
    assert_same(loss_and_grads(everything), reference)


def test_math_attention_channels_last_and_regional_compile_keep_the_result() -> None:
    reference = loss_and_grads(build_tiny(0).unet)
    with attention_context("math")():
        assert_same(loss_and_grads(build_tiny(0).unet), reference, atol=1e-6)
    unet = build_tiny(0).unet.to(memory_format=torch.channels_last)
    assert_same(loss_and_grads(unet), reference, atol=1e-5)
    compiled = build_tiny(0).unet
    keys = list(compiled.state_dict())
    compile_denoiser(
        compiled, unet_blocks(compiled), "blocks", "default", "eager"
    )  # dynamo tracing, no codegen (fast)
    assert list(compiled.state_dict()) == keys  # checkpoints and exports are unchanged
    assert_same(loss_and_grads(compiled), reference, atol=1e-5)


def test_memory_config_errors_are_one_line() -> None:
    base = {"model": {"preset": "tiny"}, "data": {"path": "x"}, "train": {"max_steps": 1}}
    with pytest.raises(ValueError, match="unknown UNet block 'left.1'"):
        build_config({**base, "memory": {"gradient_checkpointing": ["left.1"]}})
    with pytest.raises(ValueError, match="pure_bf16 needs an optimizer"):
        build_config({**base, "train": {"max_steps": 1, "mixed_precision": "pure_bf16"}})
    fused_prodigy = {"memory": {"fused_backward": True}, "optim": {"name": "prodigy"}}
    fused_prodigy["optim"]["max_grad_norm"] = None
    with pytest.raises(ValueError, match="Prodigy estimates one step size"):
        build_config({**base, **fused_prodigy})


def test_a_run_with_offloaded_blocks_trains_like_one_without(tmp_path, demo_folder) -> None:
    raw = {
        "model": {"preset": "tiny"},
        "data": {"path": str(demo_folder), "resolution": 64, "batch_size": 2},
        "optim": {"lr": 1e-3},
        "train": {"output_dir": str(tmp_path / "plain"), "max_steps": 3, "seed": 1},
        "log": {"tensorboard": False, "progress_bar": False},
    }
    offloaded = copy.deepcopy(raw)
    offloaded["memory"] = {"offload_blocks": True, "resident_blocks": 1}
    offloaded["train"]["output_dir"] = str(tmp_path / "offloaded")
    runs = [train(build_config(settings)).run_dir for settings in (raw, offloaded)]
    losses = [
        [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        for run in runs
    ]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    a, b = (load_file(run / "checkpoints/step-00000003/unet.safetensors") for run in runs)
    for name in a:  # gradients agree to ~1e-7; Adam turns that into < 1/10 of a step (lr 1e-3)
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-4, msg=name)
    offloaded["memory"]["compile"] = "blocks"
    with pytest.raises(ValueError, match="set memory.compile: none"):
        build_config(offloaded)


def test_frozen_weights_in_bf16_halve_them_and_train_like_fp32(tmp_path, demo_folder) -> None:
    """memory.frozen_dtype: bf16 holds the base weights under LoRA adapters and the frozen text
    encoders in bf16; the adapters stay fp32 and, under bf16 autocast (which rounds the weights
    to bf16 for every matmul anyway), train almost exactly as with fp32 base weights."""
    from impasto.train.setup import build_step_setup

    raw = {
        "model": {"preset": "tiny"},
        "data": {"path": str(demo_folder), "resolution": 64, "batch_size": 2},
        "parts": {"unet": "lora", "text_encoder": "lora"},
        "optim": {"lr": 1e-3},
        "train": {
            "output_dir": str(tmp_path / "fp32"),
            "max_steps": 3,
            "seed": 1,
            "mixed_precision": "bf16",
        },
        "log": {"tensorboard": False, "progress_bar": False},
    }
    half = copy.deepcopy(raw)
    half["memory"] = {"frozen_dtype": "bf16"}
    half["train"]["output_dir"] = str(tmp_path / "bf16")
    setup = build_step_setup(build_config(half), torch.device("cpu"), torch.bfloat16)
    for part in ("unet", "text_encoder", "text_encoder_2"):
        for name, parameter in getattr(setup.backbone.components, part).named_parameters():
            expected = torch.float32 if parameter.requires_grad else torch.bfloat16
            assert parameter.dtype == expected, (part, name)
    assert any(p.requires_grad for p in setup.backbone.components.unet.parameters())
    runs = [train(build_config(settings)) for settings in (raw, half)]
    losses = [
        [
            json.loads(line)["loss"]
            for line in (r.run_dir / "metrics.jsonl").read_text().splitlines()
        ]
        for r in runs
    ]
    assert len(losses[0]) == 3 and losses[0] != losses[1]
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    with pytest.raises(ValueError, match="set train.mixed_precision: bf16"):
        build_config({**half, "train": {"max_steps": 1}})
    with pytest.raises(ValueError, match="parallel.param_dtype: bf16 instead"):
        build_config({**half, "parallel": {"strategy": "fsdp"}})
