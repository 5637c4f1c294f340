"""Block offload (impasto.train.offload): same loss and gradients as the plain UNet.

On CPU the "device" is the CPU itself: the copies are then real copies with their own storage,
so the loading, recomputation and gradient return paths all run; the CUDA test adds the side
streams and checks the memory saved.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch import nn

from impasto.models.sdxl import unet_blocks
from impasto.train.offload import BlockOffload

ATOL = 1e-6  # gradients upstream of a skip connection are summed in another order


@pytest.fixture(scope="module")
def unet(tiny) -> nn.Module:
    return tiny.unet


def sdxl_inputs(device: str = "cpu") -> tuple:
    """A realistic SDXL call: latents, timesteps, prompt embeddings (with grad), added cond."""
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 4, 8, 8, generator=generator)
    prompt_embeds = torch.randn(2, 77, 64, generator=generator)
    added = {
        "text_embeds": torch.randn(2, 32, generator=generator).to(device),
        "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * 2, device=device),
    }
    timesteps = torch.tensor([10, 500], device=device)
    return latents.to(device), timesteps, prompt_embeds.to(device).requires_grad_(), added


def forward_backward(unet: nn.Module, device: str = "cpu", autocast: bool = False) -> tuple:
    """Loss, prompt-embedding gradient, and every parameter's gradient by name."""
    latents, timesteps, prompt_embeds, added = sdxl_inputs(device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        prediction = unet(latents, timesteps, prompt_embeds, added_cond_kwargs=added).sample
    loss = prediction.float().square().mean()
    loss.backward()  # outside autocast, as in training: the recomputation must restore it
    grads = {name: param.grad for name, param in unet.named_parameters()}
    return loss.detach(), prompt_embeds.grad, grads


def downstream(name: str) -> bool:
    """Parameters whose gradient needs no multi-consumer sum: equal bit for bit."""
    return name.startswith(("mid_block.", "up_blocks.", "conv_out.", "conv_norm_out."))


@pytest.mark.parametrize("resident", [0, 1])
def test_loss_and_gradients_equal_no_offload(unet: nn.Module, resident: int) -> None:
    loss, prompt_grad, grads = forward_backward(copy.deepcopy(unet))
    offloaded_unet = copy.deepcopy(unet)
    offload = BlockOffload(offloaded_unet, unet_blocks(offloaded_unet), "cpu", resident=resident)
    offload_loss, offload_prompt_grad, offload_grads = forward_backward(offloaded_unet)

    resident_names = ["up.0"][:resident]  # the largest block stays on the device
    assert offload.resident_names == resident_names
    names = [name for name, _ in unet_blocks(unet).items()]
    assert offload.offloaded_names == [name for name in names if name not in resident_names]
    assert torch.equal(offload_loss, loss)
    torch.testing.assert_close(offload_prompt_grad, prompt_grad, rtol=0, atol=ATOL)
    assert offload_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert offload_grads[name] is not None, name
        assert offload_grads[name].dtype == torch.float32
        if downstream(name):
            assert torch.equal(offload_grads[name], grad), name
        torch.testing.assert_close(offload_grads[name], grad, rtol=1e-5, atol=ATOL, msg=name)


def test_recomputation_restores_autocast(unet: nn.Module) -> None:
    """bf16 autocast in forward only: a recomputation in fp32 would change every gradient."""
    loss, _, grads = forward_backward(copy.deepcopy(unet), autocast=True)
    offloaded_unet = copy.deepcopy(unet)
    BlockOffload(offloaded_unet, unet_blocks(offloaded_unet), "cpu")
    offload_loss, _, offload_grads = forward_backward(offloaded_unet, autocast=True)
    assert torch.equal(offload_loss, loss)
    for name in [name for name in grads if downstream(name)]:
        assert torch.equal(offload_grads[name], grads[name]), name


def test_weights_live_on_device_only_while_used(unet: nn.Module) -> None:
    offloaded_unet = copy.deepcopy(unet)
    blocks = dict(unet_blocks(offloaded_unet).items())
    masters = {name: list(block.parameters()) for name, block in blocks.items()}
    offload = BlockOffload(offloaded_unet, unet_blocks(offloaded_unet), "cpu")
    copies: list[list[weakref.ref]] = []  # one entry per block load
    load = offload._load

    def counting_load(block):
        loaded = load(block)
        copies.append([weakref.ref(weight) for weight in loaded.weights])
        for weight, master in zip(loaded.weights, block.masters, strict=True):
            assert weight.data_ptr() != master.data_ptr()  # a real copy
        return loaded

    def live() -> int:
        return sum(any(ref() is not None for ref in refs) for refs in copies)

    peak = [0]

    def sample(module, args) -> None:  # runs in forward and in backward's recomputation
        peak[0] = max(peak[0], live())

    offload._load = counting_load
    for module in offloaded_unet.modules():
        module.register_forward_pre_hook(sample)

    latents, timesteps, prompt_embeds, added = sdxl_inputs()
    prediction = offloaded_unet(latents, timesteps, prompt_embeds, added_cond_kwargs=added).sample
    for name, block in blocks.items():  # between uses the module holds the CPU masters
        assert all(a is b for a, b in zip(block.parameters(), masters[name], strict=True))
        assert all(param.device.type == "cpu" for param in block.parameters())
    assert live() == 1 and offload.loaded_blocks() == ["up.1"]  # kept for backward's start
    assert peak[0] == 2
    bytes_up = sum(b.num_bytes for b in offload._blocks)
    assert len(copies) == 5

    prediction.square().mean().backward()
    assert live() == 0 and offload.loaded_blocks() == []
    assert peak[0] == 2
    assert len(copies) == 9  # each block twice but the last one
    assert offload.traffic_per_step() == (2 * bytes_up - offload._blocks[-1].num_bytes, bytes_up)


def test_gradients_accumulate_and_hooks_fire(unet: nn.Module) -> None:
    """Two micro-batches add up in .grad; post-accumulate hooks (fused backward) see them."""
    plain, offloaded_unet = copy.deepcopy(unet), copy.deepcopy(unet)
    BlockOffload(offloaded_unet, unet_blocks(offloaded_unet), "cpu")
    seen: list[torch.Tensor] = []
    offloaded_unet.up_blocks[0].resnets[0].conv1.weight.register_post_accumulate_grad_hook(
        lambda param: seen.append(param.grad.clone())
    )
    for module in (plain, offloaded_unet):
        forward_backward(module)
        forward_backward(module)
    assert len(seen) == 2 and torch.equal(seen[1], 2 * seen[0])
    for (name, param), offload_param in zip(
        plain.named_parameters(), offloaded_unet.parameters(), strict=True
    ):
        torch.testing.assert_close(offload_param.grad, param.grad, rtol=1e-5, atol=ATOL, msg=name)


def test_combines_with_diffusers_gradient_checkpointing(unet: nn.Module) -> None:
    """diffusers' own checkpointing nests inside the recomputation (redundant but correct)."""
    loss, _, grads = forward_backward(copy.deepcopy(unet))
    offloaded_unet = copy.deepcopy(unet)
    offloaded_unet.enable_gradient_checkpointing()
    masters = {
        id(param)
        for _, block in unet_blocks(offloaded_unet).items()
        for param in block.parameters()
    }
    computed_with_masters = []

    def check(module, args) -> None:  # also in diffusers' recomputation inside our backward
        if any(id(param) in masters for param in module.parameters(recurse=False)):
            computed_with_masters.append(module)

    for _, block in unet_blocks(offloaded_unet).items():
        for module in block.modules():
            module.register_forward_pre_hook(check)
    BlockOffload(offloaded_unet, unet_blocks(offloaded_unet), "cpu")
    offload_loss, _, offload_grads = forward_backward(offloaded_unet)
    assert computed_with_masters == []
    assert torch.equal(offload_loss, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(offload_grads[name], grad, rtol=1e-5, atol=ATOL, msg=name)


def test_frozen_parameters_get_no_gradient(unet: nn.Module) -> None:
    plain, offloaded_unet = copy.deepcopy(unet), copy.deepcopy(unet)
    for module in (plain, offloaded_unet):
        module.mid_block.requires_grad_(False)
    BlockOffload(offloaded_unet, unet_blocks(offloaded_unet), "cpu")
    _, _, grads = forward_backward(plain)
    _, _, offload_grads = forward_backward(offloaded_unet)
    for name, grad in grads.items():
        if name.startswith("mid_block."):
            assert grad is None and offload_grads[name] is None
        else:
            torch.testing.assert_close(offload_grads[name], grad, rtol=1e-5, atol=ATOL)


def test_no_grad_forward_and_remove_restore_the_plain_module(unet: nn.Module) -> None:
    latents, timesteps, prompt_embeds, added = sdxl_inputs()
    with torch.no_grad():
        expected = unet(latents, timesteps, prompt_embeds, added_cond_kwargs=added).sample
    offloaded_unet = copy.deepcopy(unet)
    hooks_before = len(offloaded_unet._forward_pre_hooks)
    params_before = list(offloaded_unet.parameters())
    offload = BlockOffload(offloaded_unet, unet_blocks(offloaded_unet), "cpu", resident=2)
    with torch.no_grad():
        output = offloaded_unet(latents, timesteps, prompt_embeds, added_cond_kwargs=added)
    assert torch.equal(output.sample, expected)
    assert offload.loaded_blocks() == []  # nothing kept without a backward to come

    offload.remove()
    assert len(offloaded_unet._forward_pre_hooks) == hooks_before
    assert all("forward" not in block.__dict__ for _, block in unet_blocks(offloaded_unet).items())
    assert all(a is b for a, b in zip(offloaded_unet.parameters(), params_before, strict=True))
    _, _, grads = forward_backward(copy.deepcopy(unet))
    _, _, plain_grads = forward_backward(offloaded_unet)
    for name, grad in grads.items():  # plain autograd again: bit for bit
        assert torch.equal(plain_grads[name], grad), name


def test_invalid_arguments(unet: nn.Module) -> None:
    with pytest.raises(ValueError, match="no block 'up.7'"):
        BlockOffload(copy.deepcopy(unet), unet_blocks(unet), "cpu", blocks=["mid", "up.7"])
    with pytest.raises(ValueError, match="resident must be in"):
        BlockOffload(
            copy.deepcopy(unet), unet_blocks(unet), "cpu", resident=3, blocks=["mid", "up.0"]
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("resident", [0, 1])
def test_cuda_matches_no_offload_with_less_memory(
    unet: nn.Module, resident: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    plain = copy.deepcopy(unet).to("cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    loss, prompt_grad, grads = forward_backward(plain, "cuda")
    plain_peak = torch.cuda.max_memory_allocated()
    del plain
    torch.cuda.empty_cache()

    offloaded_unet = copy.deepcopy(unet)
    offload = BlockOffload(offloaded_unet, unet_blocks(offloaded_unet), "cuda", resident=resident)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    offload_loss, offload_prompt_grad, offload_grads = forward_backward(offloaded_unet, "cuda")
    offload_peak = torch.cuda.max_memory_allocated()

    torch.testing.assert_close(offload_loss, loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(offload_prompt_grad, prompt_grad, rtol=1e-4, atol=1e-5)
    offloaded = {id(p) for block in offload._blocks for p in block.masters}
    for (name, grad), param in zip(grads.items(), offloaded_unet.parameters(), strict=True):
        offload_grad = offload_grads[name]
        if id(param) in offloaded:
            assert offload_grad.device.type == "cpu" and offload_grad.is_pinned(), name
            assert param.is_pinned(), name
        torch.testing.assert_close(offload_grad.cpu(), grad.cpu(), rtol=1e-4, atol=1e-5, msg=name)
    assert offload_peak < plain_peak, (offload_peak, plain_peak)
