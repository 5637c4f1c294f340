"""EMA of the trainable weights: closed forms, warmup, update_every, resume and swapping."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from impasto.train.ema import EMA, _lerp_foreach, _lerp_per_tensor, power_warmup_decay


def _param_sequence(num: int, shape: tuple[int, ...] = (7,), seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for _ in range(num)]


def _run(ema: EMA, param: torch.Tensor, values: list[torch.Tensor], first_step: int = 1) -> None:
    """Play an optimizer: set the parameter to each value, then call ``update`` with its step."""
    for step, value in enumerate(values, start=first_step):
        with torch.no_grad():
            param.copy_(value)
        ema.update(step)


def test_constant_decay_matches_closed_form() -> None:
    decay, num_steps = 0.9, 12
    p0, *values = _param_sequence(num_steps + 1)
    param = nn.Parameter(p0.clone())
    ema = EMA([("w", param)], decay=decay)
    _run(ema, param, values)
    # shadow_N = d^N·p0 + Σ_k (1 − d)·d^(N−k)·p_k, in float64.
    expected = decay**num_steps * p0.double()
    for k, value in enumerate(values, start=1):
        expected += (1 - decay) * decay ** (num_steps - k) * value.double()
    assert ema.num_updates == num_steps
    torch.testing.assert_close(ema.shadows[0].double(), expected, rtol=0, atol=1e-6)
    assert not torch.allclose(ema.shadows[0], values[-1], atol=1e-2)  # it really lags


def test_power_warmup_values() -> None:
    # 1 − (1 + t)^(−2/3) at inv_gamma = 1: 0 at t = 0, 1 − 2^(−2/3) at t = 1, 0.999 at
    # t = 10^4.5 − 1; capped at decay.
    assert power_warmup_decay(0, 0.9999) == 0.0
    assert power_warmup_decay(1, 0.9999) == pytest.approx(0.370039475, abs=1e-9)
    assert power_warmup_decay(10**4.5 - 1, 0.9999) == pytest.approx(0.999, abs=1e-12)
    assert power_warmup_decay(10, 0.9999, inv_gamma=2.0, power=0.75) == pytest.approx(
        1 - 6**-0.75, abs=1e-12
    )
    for t in (10**6, 10**8):
        assert power_warmup_decay(t, 0.9999) == 0.9999
    param = nn.Parameter(torch.zeros(3))
    ema = EMA([("w", param)], decay=0.99, warmup="power")
    decays = []
    for step in range(1, 2001):
        decays.append(ema.next_decay())
        ema.update(step)
    assert decays[:4] == [power_warmup_decay(t, 0.99) for t in range(4)]
    assert max(decays) == 0.99 and all(a <= b for a, b in zip(decays, decays[1:], strict=False))


def test_warmup_decay_equals_diffusers() -> None:
    from diffusers.training_utils import EMAModel

    values = _param_sequence(30, shape=(4, 3), seed=1)
    param = nn.Parameter(values[0].clone())
    reference_param = nn.Parameter(values[0].clone())
    ema = EMA([("w", param)], decay=0.95, warmup="power", inv_gamma=2.0, power=0.75)
    reference = EMAModel(
        [reference_param], decay=0.95, use_ema_warmup=True, inv_gamma=2.0, power=0.75
    )
    for step, value in enumerate(values[1:], start=1):
        with torch.no_grad():
            param.copy_(value)
            reference_param.copy_(value)
        decay = ema.next_decay()
        ema.update(step)
        reference.step([reference_param])
        assert decay == reference.cur_decay_value
    torch.testing.assert_close(ema.shadows[0], reference.shadow_params[0], rtol=1e-6, atol=1e-6)


def test_first_warmup_update_copies_the_weights() -> None:
    param = nn.Parameter(torch.zeros(5))
    ema = EMA([("w", param)], warmup="power")
    value = torch.tensor([1.0, -2.0, 3.5, 1e-3, 7.25])
    _run(ema, param, [value])
    assert torch.equal(ema.shadows[0], value)


@pytest.mark.parametrize("warmup", ["none", "power"])
def test_update_every_equals_single_updates_on_piecewise_constant_weights(warmup: str) -> None:
    # The weights hold one value per window of N steps; one update per window with the
    # product of the N per-step decays then equals N single updates.
    num_every, decay, num_windows = 4, 0.9, 3
    start = torch.full((6,), 2.0)
    window_values = _param_sequence(num_windows, shape=(6,), seed=4)
    params = [nn.Parameter(start.clone()) for _ in range(2)]
    every = EMA([("w", params[0])], decay=decay, warmup=warmup, update_every=num_every)
    single = EMA([("w", params[1])], decay=decay, warmup=warmup)
    if warmup == "none":
        assert every.next_decay() == decay**num_every
    for step in range(1, num_windows * num_every + 1):
        for param in params:
            with torch.no_grad():
                param.copy_(window_values[(step - 1) // num_every])
        updated = every.update(step)
        single.update(step)
        assert updated == (step % num_every == 0)
        if step == num_every - 1:
            assert torch.equal(every.shadows[0], start)  # nothing before step N
    assert every.num_updates == num_windows and single.num_updates == num_windows * num_every
    torch.testing.assert_close(every.shadows[0], single.shadows[0], rtol=0, atol=1e-6)
    assert not torch.allclose(every.shadows[0], window_values[-1], atol=1e-2)


def test_state_dict_round_trip_continues_bitwise() -> None:
    values = _param_sequence(20, shape=(3, 5), seed=2)
    options = {"decay": 0.97, "warmup": "power", "update_every": 2}
    param = nn.Parameter(torch.zeros(3, 5))
    straight = EMA([("layer.weight", param)], **options)
    _run(straight, param, values)

    param = nn.Parameter(torch.zeros(3, 5))
    first = EMA([("layer.weight", param)], **options)
    _run(first, param, values[:11])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["num_updates"] == 5 and state["options"]["warmup"] == "power"

    param = nn.Parameter(torch.full((3, 5), 9.0))
    resumed = EMA([("layer.weight", param)], **options)
    resumed.load_state_dict(state)
    _run(resumed, param, values[11:], first_step=12)
    assert resumed.num_updates == straight.num_updates == 10
    assert torch.equal(resumed.shadows[0], straight.shadows[0])


def _trained_bf16_linear() -> tuple[nn.Linear, EMA, dict[str, torch.Tensor]]:
    model = nn.Linear(4, 3).to(torch.bfloat16)
    ema = EMA(model.named_parameters(), decay=0.5)
    for step in range(1, 4):
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.25 * step)
        ema.update(step)
    training = {name: p.detach().clone() for name, p in model.named_parameters()}
    return model, ema, training


def test_swapped_holds_ema_weights_and_restores_exactly() -> None:
    model, ema, training = _trained_bf16_linear()
    with ema.swapped():
        for (name, param), shadow in zip(model.named_parameters(), ema.shadows, strict=True):
            assert torch.equal(param, shadow.to(torch.bfloat16))
            assert not torch.equal(param, training[name])
        out = model(torch.ones(2, 4, dtype=torch.bfloat16))
    assert out.requires_grad  # the block runs in the caller's grad mode
    for name, param in model.named_parameters():
        assert torch.equal(param, training[name])

    with pytest.raises(RuntimeError, match="sampling failed"), ema.swapped():
        assert torch.equal(model.weight, ema.shadows[0].to(torch.bfloat16))
        raise RuntimeError("sampling failed")
    for name, param in model.named_parameters():
        assert torch.equal(param, training[name])


def test_copy_to_another_module_by_name() -> None:
    model, ema, _ = _trained_bf16_linear()
    export = nn.Sequential()
    export.add_module("weight_holder", nn.Linear(4, 3))  # wrong names
    with pytest.raises(ValueError, match="missing from the target"):
        ema.copy_to(export.named_parameters())
    copy = nn.Linear(4, 3)  # fp32, same names
    extra = [("frozen.base", torch.zeros(2))]  # ignored
    ema.copy_to([*copy.named_parameters(), *extra])
    assert torch.equal(copy.weight, ema.shadows[0]) and torch.equal(copy.bias, ema.shadows[1])
    with pytest.raises(ValueError, match="shape mismatch for 'weight'"):
        ema.copy_to(nn.Linear(5, 3).named_parameters())


def test_cpu_shadows_are_fp32_and_keep_sub_bf16_steps() -> None:
    param = nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    ema = EMA([("w", param)], decay=0.999, device="cpu")
    assert ema.shadows[0].device.type == "cpu" and ema.shadows[0].dtype == torch.float32
    with torch.no_grad():
        param.fill_(2.0)
    ema.update(1)
    # 1 + 0.001·(2 − 1): bf16 (8 bits of mantissa) would round this back to 1.
    torch.testing.assert_close(ema.shadows[0], torch.full((8,), 1.001), rtol=0, atol=1e-7)
    assert param.dtype == torch.bfloat16
    assert torch.equal(ema.shadows[0].bfloat16(), torch.ones(8, dtype=torch.bfloat16))


def test_per_tensor_path_equals_foreach_path() -> None:
    values = _param_sequence(5, shape=(16,), seed=3)
    params = [values[0].bfloat16(), values[1], values[2][:3]]
    shadows_a = [values[3].clone(), values[4].clone(), values[0][:3].clone()]
    shadows_b = [s.clone() for s in shadows_a]
    _lerp_foreach(shadows_a, params, 0.3)
    _lerp_per_tensor(shadows_b, params, 0.3)
    for a, b in zip(shadows_a, shadows_b, strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(shadows_a[1], 0.7 * values[4] + 0.3 * values[1])


def test_mismatched_state_and_bad_options_raise() -> None:
    ema = EMA([("a", nn.Parameter(torch.zeros(2, 3)))])
    good = ema.state_dict()
    renamed = {**good, "shadows": {"b": torch.zeros(2, 3)}}
    with pytest.raises(ValueError, match="1 missing .*1 unexpected"):
        ema.load_state_dict(renamed)
    reshaped = {**good, "shadows": {"a": torch.zeros(3, 2)}}
    with pytest.raises(ValueError, match=r"shape mismatch for 'a': \(3, 2\) saved, \(2, 3\)"):
        ema.load_state_dict(reshaped)
    with pytest.raises(ValueError, match="valid: none, power"):
        EMA([("a", nn.Parameter(torch.zeros(1)))], warmup="linear")
    with pytest.raises(ValueError, match="valid: same, cpu"):
        EMA([("a", nn.Parameter(torch.zeros(1)))], device="cuda")
    with pytest.raises(ValueError, match="decay must be in"):
        EMA([("a", nn.Parameter(torch.zeros(1)))], decay=1.5)
    with pytest.raises(ValueError, match="1-based"):
        ema.update(0)


def test_a_training_run_keeps_saves_and_resumes_its_ema(tmp_path, demo_folder) -> None:
    import copy

    from safetensors.torch import load_file

    from impasto.config import build_config
    from impasto.models import load_model
    from impasto.train.trainer import train

    raw = {
        "model": {"preset": "tiny"},
        "data": {"path": str(demo_folder), "resolution": 64, "batch_size": 2},
        "optim": {"lr": 1e-3},
        "ema": {"enabled": True, "decay": 0.5},
        "train": {"output_dir": str(tmp_path / "straight"), "max_steps": 3, "seed": 1},
        "checkpoint": {"every_steps": 1, "keep_last": 3},
        "log": {"tensorboard": False, "progress_bar": False},
    }
    config = build_config(raw)
    run = train(config).run_dir
    shadow = {f"unet.{k}": v.float() for k, v in load_model(config).unet.state_dict().items()}
    for step in (1, 2, 3):  # shadow_k = d * shadow_(k-1) + (1 - d) * weights_k
        weights = load_file(run / f"checkpoints/step-{step:08d}/unet.safetensors")
        shadow = {k: 0.5 * v + 0.5 * weights[k.removeprefix("unet.")] for k, v in shadow.items()}
    saved = load_file(run / "checkpoints/step-00000003/ema.safetensors")
    assert saved.keys() == shadow.keys()
    for name, value in shadow.items():
        torch.testing.assert_close(saved[name], value, rtol=1e-6, atol=1e-7)

    resumed = copy.deepcopy(raw)
    resumed["train"].update(output_dir=str(tmp_path / "resumed"), max_steps=2)
    train(build_config(resumed))
    resumed["train"]["max_steps"] = 3
    again = train(build_config(resumed)).run_dir
    other = load_file(again / "checkpoints/step-00000003/ema.safetensors")
    assert all(torch.equal(saved[name], other[name]) for name in saved)

    from impasto.checkpoint.trained import load_trained
    from impasto.cli import main

    _, with_ema = load_trained(run, ema=True)

    with_ema = with_ema.components
    for name, value in with_ema.unet.state_dict().items():
        assert torch.equal(value, saved[f"unet.{name}"]), name
    out = tmp_path / "export.safetensors"
    assert main(["export", str(run), "--format", "single-file", "--dtype", "fp32",
                 "--ema", "--out", str(out)]) == 0  # fmt: skip
    exported = load_file(out)
    key = "model.diffusion_model.out.2.weight"  # the UNet's conv_out in the SGM layout
    assert torch.equal(exported[key], saved["unet.conv_out.weight"])
    plain = dict(raw, ema={"enabled": False})
    plain["train"] = dict(raw["train"], output_dir=str(tmp_path / "plain"), max_steps=1)
    plain_run = train(build_config(plain)).run_dir
    with pytest.raises(ValueError, match="no ema.safetensors; the run trained without ema"):
        load_trained(plain_run, ema=True)
