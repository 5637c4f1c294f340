"""DRaFT+ (issue #15): the KL term, where gradients flow, the truncated sampler against
``impasto sample``, every objective, LoRA and full fine-tuning, exact resume and the config's
one-line errors. The demo end to end is tests/test_draftp_demo.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file

from impasto.config import build_config
from impasto.config.load import ConfigError
from impasto.inference import model_sampling_options
from impasto.models.parts import adapters_disabled
from impasto.rewards import REWARDS, register_reward
from impasto.sampling import generate_latents, initial_noise
from impasto.train.checks import check_config
from impasto.train.methods import WHOLE_STEP
from impasto.train.methods.draftp import (
    gradient_step,
    kl_penalty,
    pairwise_diversity,
    reward_summary,
    truncated_sample,
)
from impasto.train.setup import build_step_setup
from impasto.train.trainer import train

PROMPTS = ["a red circle", "a blue square", "a green triangle", "a cyan circle"]


class Brightness:
    """A differentiable test reward: the mean pixel value, and 8×8-pooled pixels to embed."""

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        assert len(prompts) == images.shape[0]
        return images.mean(dim=(1, 2, 3))

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.avg_pool2d(images, 8).flatten(1)


@pytest.fixture(autouse=True)
def brightness() -> Iterator[None]:
    register_reward("brightness")(lambda config, device: Brightness())
    yield
    REWARDS.pop("brightness")


@pytest.fixture
def prompt_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    return path


def _raw(prompt_file: Path, run_dir: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    raw = {
        "model": {"preset": "tiny"},
        "objective": {"method": "draftp"},
        "data": {"prompts": str(prompt_file), "resolution": 64, "batch_size": 2},
        "parts": {"unet": "lora"},
        "lora": {"rank": 4},
        "reward": {"kind": "brightness"},
        "draftp": {"num_steps": 5, "truncation_steps": 2, "guidance_scale": 2.0},
        "optim": {"lr": 1e-2, "weight_decay": 0.0},
        "train": {"output_dir": str(run_dir), "seed": 3, "max_steps": 4},
        "checkpoint": {"every_steps": 2},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def _setup(raw: dict[str, Any]):
    config = build_config(raw)
    check_config(config)
    return config, build_step_setup(config, torch.device("cpu"), None)


def test_kl_term_of_a_constant_difference_of_0_1_is_0_01(prompt_file, tmp_path):
    tuned, base = torch.full((2, 4, 8, 8), 1.3), torch.full((2, 4, 8, 8), 1.2)
    torch.testing.assert_close(kl_penalty(tuned, base), torch.tensor(0.01))
    # Through a sampler step: D_ft = D_base − 0.1·σ makes d = (x − D)/σ differ by exactly 0.1.
    _, setup = _setup(_raw(prompt_file, tmp_path / "run"))
    plan = setup.method.plan
    base_denoiser = lambda x, sigma, t: 0.5 * x  # noqa: E731
    tuned_denoiser = lambda x, sigma, t: 0.5 * x - 0.1 * sigma  # noqa: E731
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    for index in (0, 2, 4):
        _, penalty = gradient_step(plan, tuned_denoiser, base_denoiser, x, index, False)
        torch.testing.assert_close(penalty.float(), torch.tensor(0.01))


def test_gradients_reach_only_the_adapters_through_the_last_k_steps(prompt_file, tmp_path):
    raw = _raw(prompt_file, tmp_path / "run", draftp={"checkpoint_steps": False})
    config, setup = _setup(raw)
    method, unet = setup.method, setup.backbone.denoiser()
    with torch.no_grad():  # make the adapters act (LoRA B starts at zero)
        for name, param in unet.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    layer = next(m for m in unet.modules() if isinstance(m, BaseTunerLayer))
    calls: list[tuple[bool, bool]] = []  # (grad enabled, adapters on) per UNet call
    hook = unet.register_forward_pre_hook(
        lambda module, args: calls.append((torch.is_grad_enabled(), not layer.disable_adapters))
    )
    batch = _prompt_batch(PROMPTS[:2])
    out = method.step(batch, torch.Generator().manual_seed(0), WHOLE_STEP)
    hook.remove()
    num_steps, k = config.draftp.num_steps, config.draftp.truncation_steps
    # The prefix runs without gradients; each gradient step first evaluates the base (adapters
    # off, no gradients), then the fine-tuned model with gradients.
    prefix = [(False, True)] * (num_steps - k)
    assert calls == prefix + [(False, False), (True, True)] * k
    out.loss.backward()
    trained = {name for name, param in unet.named_parameters() if param.requires_grad}
    assert trained and all(".lora_" in name for name in trained)
    for module in setup.backbone.modules().values():
        for name, param in module.named_parameters():
            if name in trained and module is unet:
                assert param.grad is not None and torch.isfinite(param.grad).all()
            else:
                assert param.grad is None, name
    assert sum(float(unet.get_parameter(name).grad.abs().sum()) for name in trained) > 0


def test_earlier_steps_carry_no_graph(prompt_file, tmp_path):
    _, setup = _setup(_raw(prompt_file, tmp_path / "run"))
    plan = setup.method.plan
    weight = torch.tensor(0.7, requires_grad=True)
    tuned = lambda x, sigma, t: weight * x / (sigma**2 + 1)  # noqa: E731
    base = lambda x, sigma, t: x / (sigma**2 + 1)  # noqa: E731
    x = torch.randn(1, 4, 8, 8)
    states: list[torch.Tensor] = []
    trajectory = truncated_sample(plan, tuned, base, x, 2, False, lambda i, s, d: states.append(s))
    assert len(states) == 3 and not any(state.requires_grad for state in states)
    (grad,) = torch.autograd.grad(trajectory.state.sum(), weight)
    # By hand: only the last two Euler steps depend on the weight.
    sigmas = plan.sigmas.double()
    y = states[-1].double()
    weight_value = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    for index in (3, 4):
        denoised = weight_value * y / (sigmas[index] ** 2 + 1)
        y = y + (y - denoised) / sigmas[index] * (sigmas[index + 1] - sigmas[index])
    (expected,) = torch.autograd.grad(y.sum(), weight_value)
    torch.testing.assert_close(grad.double(), expected, rtol=1e-4, atol=1e-4)


def _prompt_batch(prompts: list[str]):
    from impasto.data import Batch

    sizes = torch.tensor([[64, 64]] * len(prompts))
    return Batch(
        pixel_values=None, captions=prompts, original_sizes=sizes,
        crop_top_lefts=torch.zeros_like(sizes), target_sizes=sizes,
        indices=torch.arange(len(prompts)),
    )  # fmt: skip


OBJECTIVES = {
    "epsilon": {},
    "v_ztsnr": {"prediction_type": "v_prediction", "zero_terminal_snr": True},
    "flow": {"prediction_type": "flow", "timestep_sampling": "logit_normal"},
}


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_no_grad_prefix_equals_impasto_sample(objective, prompt_file, tmp_path):
    raw = _raw(prompt_file, tmp_path / "run", objective=OBJECTIVES[objective])
    raw["draftp"] |= {"num_steps": 6, "truncation_steps": 2}
    config, setup = _setup(raw)
    method, backbone = setup.method, setup.backbone
    backbone.denoiser().eval()
    prompts = PROMPTS[:2]
    expected: list[torch.Tensor] = []
    generate_latents(
        backbone, prompts, num_steps=6, guidance_scale=2.0, seed=11, height=64, width=64,
        callback=lambda i, x, d: expected.append(x), **model_sampling_options(config),
    )  # fmt: skip
    if objective == "v_ztsnr":  # trailing spacing starts at the terminal σ
        assert float(method.plan.sigmas[0]) == pytest.approx(config.objective.terminal_sigma)
    tuned, base = method.denoisers(prompts)
    x = initial_noise(2, method.shape, 11) * method.plan.noise_scale
    seen: list[torch.Tensor] = []
    truncated_sample(method.plan, tuned, base, x, 2, True, lambda i, s, d: seen.append(s))
    assert len(seen) == 4
    for mine, theirs in zip(seen, expected[:4], strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_every_objective_trains_with_finite_gradients(objective, prompt_file, tmp_path):
    raw = _raw(prompt_file, tmp_path / "run", objective=OBJECTIVES[objective])
    if objective == "v_ztsnr":  # every step with gradients, the first at σ = 20000
        raw["draftp"] |= {"num_steps": 3, "truncation_steps": 3}
    _, setup = _setup(raw)
    out = setup.method.step(_prompt_batch(PROMPTS[:2]), torch.Generator().manual_seed(1))
    out.loss.backward()
    grads = [p.grad for p in setup.params]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    assert torch.isfinite(out.metrics["reward"]) and float(out.metrics["kl"]) == 0.0


def test_full_fine_tune_keeps_a_frozen_base(prompt_file, tmp_path):
    _, setup = _setup(_raw(prompt_file, tmp_path / "run", parts={"unet": "full"}))
    method = setup.method
    x, t = torch.randn(1, 4, 8, 8), torch.tensor(500.0)
    cond = setup.backbone.sampling_condition(PROMPTS[:1], 64, 64)
    before = method.base_network(x, t, cond)
    for _ in range(2):
        out = setup.method.step(_prompt_batch(PROMPTS[:2]), torch.Generator().manual_seed(2))
        out.loss.backward()
        setup.update(None)
    assert torch.equal(method.base_network(x, t, cond), before)  # the base never moves
    assert not torch.equal(method.tuned_network(x, t, cond), before)  # the model did


def test_lora_base_is_the_model_with_adapters_off(prompt_file, tmp_path):
    _, setup = _setup(_raw(prompt_file, tmp_path / "run"))
    method, unet = setup.method, setup.backbone.denoiser()
    with torch.no_grad():
        for name, param in unet.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    x, t = torch.randn(1, 4, 8, 8), torch.tensor(300.0)
    cond = setup.backbone.sampling_condition(PROMPTS[:1], 64, 64)
    with adapters_disabled(unet):
        plain = method.tuned_network(x, t, cond)
    assert torch.equal(method.base_network(x, t, cond), plain)
    assert not torch.equal(method.tuned_network(x, t, cond), plain)
    assert all(p.requires_grad for n, p in unet.named_parameters() if "lora_" in n)


def test_resume_is_exact_and_lv_trains(prompt_file, tmp_path):
    sections = {"ema": {"enabled": True, "decay": 0.5}, "lora": {"rank": 4, "dropout": 0.1}}
    straight = train(build_config(_raw(prompt_file, tmp_path / "a", **sections)))
    raw = _raw(prompt_file, tmp_path / "b", **sections)
    raw["train"]["max_steps"] = 2
    train(build_config(raw))
    resumed = train(build_config(_raw(prompt_file, tmp_path / "b", **sections)))
    assert resumed.state.step == straight.state.step == 4
    for name in ("unet", "ema"):
        a = load_file(straight.last_checkpoint / f"{name}.safetensors")
        b = load_file(resumed.last_checkpoint / f"{name}.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lv = _raw(prompt_file, tmp_path / "lv", draftp={"lv_samples": 2, "truncation_steps": 1})
    lv["train"]["max_steps"] = 2
    result = train(build_config(lv))
    rows = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert [row["step"] for row in rows] == [1, 2] and all("reward" in row for row in rows)


def test_validation_metrics_and_summary(prompt_file, tmp_path):
    sample = {"every_steps": 2, "prompts": PROMPTS[:2], "images_per_prompt": 3, "num_steps": 4}
    result = train(build_config(_raw(prompt_file, tmp_path / "run", sample=sample)))
    rows = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    validation = [row for row in rows if "val/reward" in row]
    assert [row["step"] for row in validation] == [0, 2, 4]  # a baseline before the first step
    assert all(0 < row["val/diversity"] < 2 for row in validation)
    summary = json.loads((result.run_dir / "draftp-summary.json").read_text())
    assert summary == reward_summary(result.run_dir / "metrics.jsonl")
    train_rows = [row for row in rows if "kl" in row]
    assert summary["train"]["max_kl"] == max(row["kl"] for row in train_rows)
    assert [v["step"] for v in summary["validation"]] == [0, 2, 4]


def test_pairwise_diversity_values():
    same = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 3.0], [0.0, 3.0]])
    assert float(pairwise_diversity(same, 2)) == 0.0
    opposite = torch.tensor([[1.0, 0.0], [-2.0, 0.0]])
    assert float(pairwise_diversity(opposite, 2)) == pytest.approx(2.0)
    orthogonal = torch.tensor([[1.0, 0.0], [0.0, 5.0], [0.0, 0.0 + 1.0]])
    # pairs (a,b) √2, (a,c) √2, (b,c) 0 → mean √2·2/3
    assert float(pairwise_diversity(orthogonal, 3)) == pytest.approx(2 * 2**0.5 / 3, rel=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"parts": {"unet": "lora", "text_encoder": "lora"}}, "set parts.text_encoder: frozen"),
        ({"draftp": {"sampler": "dpmpp_2m"}}, "draftp.sampler: 'dpmpp_2m' cannot be cut"),
        ({"draftp": {"lv_samples": 2, "truncation_steps": 2}}, "set truncation_steps: 1"),
        (
            {"draftp": {"sampler": "ddim"}, "objective": {"prediction_type": "flow"}},
            "draftp.sampler: 'ddim' cannot sample a flow model",
        ),
        ({"draftp": {"truncation_steps": 9, "num_steps": 5}}, "more than the 5 sampler steps"),
        (
            {"objective": {"method": "denoise"}},
            "data.prompts: objective.method denoise trains on images",
        ),
        ({"reward": {"kind": "nope"}}, "reward.kind: unknown reward 'nope'"),
        ({"reward": {"kind": "weighted"}}, "list at least one term"),
    ],
)
def test_config_errors_are_one_line(change, message, prompt_file, tmp_path):
    raw = _raw(prompt_file, tmp_path / "run", **change)
    with pytest.raises((ConfigError, ValueError)) as error:
        check_config(build_config(raw))
    assert message in str(error.value) and "\n" not in str(error.value).strip()


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("p.txt", "\n\n", "holds no prompt"),
        ("p.jsonl", '{"prompt": "a"}\nnot json\n', "p.jsonl:2 is not JSON"),
        ("p.jsonl", '{"image": "x.png"}\n', "no string field prompt / caption / text"),
        ("p.csv", "a\n", "is neither .txt"),
    ],
)
def test_bad_prompt_files(name, text, message, tmp_path):
    from impasto.data.prompts import read_prompts

    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        read_prompts(path)
    with pytest.raises(ValueError, match="does not exist"):
        read_prompts(tmp_path / "missing.txt")


def test_prompt_files_read_txt_and_jsonl(tmp_path):
    from impasto.data.prompts import read_prompts

    (tmp_path / "p.jsonl").write_text(
        '{"prompt": "one"}\n\n{"caption": "two", "x": 1}\n{"text": "three"}\n', encoding="utf-8"
    )
    records = read_prompts(tmp_path / "p.jsonl")
    assert [r.caption for r in records] == ["one", "two", "three"]
    assert [str(r.image_path).rsplit(":", 1)[1] for r in records] == ["1", "3", "4"]
    (tmp_path / "p.txt").write_text(" first \nsecond\n", encoding="utf-8")
    assert [r.caption for r in read_prompts(tmp_path / "p.txt")] == ["first", "second"]


def test_model_path_names_an_impasto_run(prompt_file, tmp_path, demo_folder):
    from impasto.checkpoint.trained import build_starting_backbone, load_trained

    source = {
        "model": {"preset": "tiny"},
        "objective": {"prediction_type": "v_prediction"},
        "data": {"path": str(demo_folder), "resolution": 64, "batch_size": 2},
        "parts": {"unet": "lora"},
        "lora": {"rank": 4},
        "optim": {"lr": 1e-2},
        "train": {"output_dir": str(tmp_path / "source"), "max_steps": 2},
        "log": {"tensorboard": False, "progress_bar": False},
    }
    train(build_config(source))
    raw = _raw(
        prompt_file, tmp_path / "run", model={"preset": None, "path": str(tmp_path / "source")}
    )
    with pytest.raises(ValueError, match="objective.prediction_type: v_prediction"):
        build_starting_backbone(build_config(raw))
    raw["objective"] |= {"prediction_type": "v_prediction"}
    merged = build_starting_backbone(build_config(raw))
    _, trained = load_trained(tmp_path / "source")
    x, t = torch.randn(1, 4, 8, 8), torch.tensor(400.0)
    cond = trained.sampling_condition(PROMPTS[:1], 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(merged.forward(x, t, cond), trained.forward(x, t, cond))
    assert not any("lora_" in name for name, _ in merged.denoiser().named_parameters())


def test_draftp_tunes_a_dit(prompt_file, tmp_path):
    """DRaFT+ is family-blind: a DiT's adapters learn from the reward through the last K steps
    and its KL leash is the same DiT with its adapters off (issue #31)."""
    raw = _raw(
        prompt_file, tmp_path / "run", objective=OBJECTIVES["flow"],
        model={"family": "dit", "preset": "tiny"},
    )  # fmt: skip
    raw["parts"] = {"transformer": "lora"}
    _, setup = _setup(raw)
    method, transformer = setup.method, setup.backbone.denoiser()
    with torch.no_grad():  # a trained-looking DiT: the zero init passes no gradient inward
        for name, param in transformer.named_parameters():
            if "lora_" not in name:
                param.add_(torch.randn_like(param) * 0.05)
    out = method.step(_prompt_batch(PROMPTS[:2]), torch.Generator().manual_seed(1))
    out.loss.backward()
    grads = {n: p.grad for n, p in transformer.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n for n in grads)
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert sum(float(g.abs().sum()) for g in grads.values()) > 0
    x, t = torch.randn(1, 4, 8, 8), torch.tensor(500.0)
    cond = setup.backbone.sampling_condition(PROMPTS[:1], 64, 64)
    with adapters_disabled(transformer):
        plain = method.tuned_network(x, t, cond)
    torch.testing.assert_close(method.base_network(x, t, cond), plain, rtol=0, atol=0)
