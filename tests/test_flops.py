"""FLOPs of a step, TFLOP/s and MFU (issue #18): counts equal the analytic ones, a count is
made once per shape, and counting leaves the step's numbers bit-identical."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from impasto.logging.flops import FlopMeter, peak_tflops, tflops_and_mfu
from impasto.logging.system import peak_memory
from impasto.models.presets import build_tiny
from impasto.models.sdxl import unet_blocks
from impasto.train.memory import set_gradient_checkpointing


def unet_loss(unet: torch.nn.Module, batch: int = 2) -> torch.Tensor:
    """An SDXL-shaped call of the tiny UNet and an MSE loss against a fixed target."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(batch, 4, 8, 8, generator=generator)
    context = torch.randn(batch, 77, 64, generator=generator)
    added = {"text_embeds": torch.randn(batch, 32, generator=generator)}
    added["time_ids"] = torch.ones(batch, 6)
    target = torch.randn(batch, 4, 8, 8, generator=generator)
    out = unet(x, torch.full((batch,), 500), context, added_cond_kwargs=added).sample
    return torch.nn.functional.mse_loss(out, target)


def gradients(unet: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {name: p.grad.clone() for name, p in unet.named_parameters()}
    unet.zero_grad(set_to_none=True)
    return out


def test_a_linear_layer_counts_2mnk_forward_and_twice_that_backward() -> None:
    m, k, n = 8, 16, 32
    layer = torch.nn.Linear(k, n)
    x = torch.randn(m, k, requires_grad=True)  # so backward computes the input's gradient too
    meter = FlopMeter()
    with meter.measure("linear"):
        layer(x).sum().backward()
    assert meter.flops("linear") == 3 * 2 * m * n * k  # y = xWᵀ; dx = dy W; dW = dyᵀ x


def test_a_convolution_counts_its_multiply_adds_three_times() -> None:
    batch, c_in, c_out, size, kernel = 2, 3, 5, 8, 3
    conv = torch.nn.Conv2d(c_in, c_out, kernel, padding=1)
    x = torch.randn(batch, c_in, size, size, requires_grad=True)
    meter = FlopMeter()
    with meter.measure((batch, c_in, size, size)):
        conv(x).sum().backward()
    forward = 2 * batch * c_out * size * size * c_in * kernel * kernel  # same-size output
    assert meter.flops((batch, c_in, size, size)) == 3 * forward  # forward, dx, dW


def test_a_key_is_counted_once_and_a_failed_count_is_not_kept() -> None:
    layer, meter = torch.nn.Linear(4, 4), FlopMeter()
    assert meter.flops("a") is None
    with pytest.raises(RuntimeError, match="boom"), meter.measure("a"):
        layer(torch.randn(2, 4))
        raise RuntimeError("boom")
    assert meter.flops("a") is None  # the block did not finish: counted again next time
    with meter.measure("a"):
        layer(torch.randn(2, 4))
    with meter.measure("a"):  # seen: not counted again (a larger batch would count more)
        layer(torch.randn(64, 4))
    assert meter.flops("a") == 2 * 2 * 4 * 4


def test_the_tiny_unet_step_counts_as_the_library_does_and_keeps_its_gradients() -> None:
    unet = build_tiny(0).unet
    unet_loss(unet).backward()
    plain = gradients(unet)
    meter = FlopMeter()
    with meter.measure((2, 4, 8, 8)):
        unet_loss(unet).backward()
    counted = gradients(unet)
    for name, grad in plain.items():  # bit-identical: counting changes no number
        assert torch.equal(counted[name], grad), name
    with meter.measure((1, 4, 8, 8)):
        unet_loss(unet, batch=1).backward()
    with FlopCounterMode(display=False) as library:
        unet_loss(unet).backward()
    flops = meter.flops((2, 4, 8, 8))
    assert flops == library.get_total_flops() > 0  # the same formulas as FlopCounterMode
    assert meter.flops((1, 4, 8, 8)) == flops // 2  # every op's count is linear in the batch


def test_gradient_checkpointing_counts_the_recomputed_forward() -> None:
    """With checkpointing the forward runs again in backward: the count is what ran (HFU)."""
    unet = build_tiny(0).unet
    plain, checkpointed, forward = FlopMeter(), FlopMeter(), FlopMeter()
    with forward.measure("step"), torch.no_grad():
        unet_loss(unet)
    with plain.measure("step"):
        unet_loss(unet).backward()
    set_gradient_checkpointing(unet, unet_blocks(unet), "all")
    with checkpointed.measure("step"):
        unet_loss(unet).backward()
    extra = checkpointed.flops("step") - plain.flops("step")
    assert 0 < extra <= forward.flops("step")  # the checkpointed blocks' forward, once more


def test_tflops_and_mfu() -> None:
    assert tflops_and_mfu(2 * 10**12, 0.5, 8.0) == {"tflops": 4.0, "mfu": 0.5}
    assert tflops_and_mfu(2 * 10**12, 0.5, None) == {"tflops": 4.0}  # peak unknown: no MFU
    assert tflops_and_mfu(10**12, 0.0, 8.0) == {}


def test_a_cpu_has_no_known_peak_and_no_peak_memory() -> None:
    assert peak_tflops(torch.device("cpu")) is None
    memory = peak_memory(torch.device("cpu"))  # the process's peak RSS instead
    assert "peak_memory_gib" not in memory and memory["peak_rss_gib"] > 0.1
