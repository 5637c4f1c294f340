"""DRaFT+: reward fine-tuning through the sampler, with a KL leash to the base model
(``objective.method: draftp``; docs/draftp.md).

DRaFT (Clark et al. 2023, arXiv:2309.17400) treats sampling as a recurrent network and
backpropagates a differentiable reward of the sampled image into the denoiser; DRaFT-K stops the
gradients at all but the last K steps. DRaFT+ as NVIDIA NeMo-Aligner implements it
(``megatron_sdxl_draftp_model.py``, ../shared/reference/algorithms.md §7) adds a penalty on how
far the fine-tuned model's step direction d = (x − D(x; σ))/σ drifts from the base model's at
the same x and σ:

    loss = −mean(r) + kl_coeff · mean over the K steps of mean((d_ft − d_base)²)

The base is the denoiser with its adapters disabled (LoRA, DoRA, ...) or a frozen copy of the
starting weights (full fine-tuning). DRaFT-LV (``lv_samples`` n) samples x0 without gradients,
re-noises it n times to the last step's level and averages the n one-step rewards.

Every draw comes from the step's generator for the whole global batch (``Rows``), so the run
resumes exactly and does not depend on how the batch is split over ranks and micro-steps.
"""

from __future__ import annotations

import copy
import json
import statistics
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from impasto.data import Batch
from impasto.faults import writing
from impasto.inference import model_sampling_options
from impasto.logging import METRICS_FILE
from impasto.models.backbone import Backbone
from impasto.models.parts import has_adapters, without_adapters
from impasto.rewards import Reward, build_reward
from impasto.sampling import SamplingPlan, SamplingRequest, model_forward, sampling_plan
from impasto.sampling.generate import embed_guidance
from impasto.sampling.process import family_plan
from impasto.sampling.samplers import Denoiser, StepCallback
from impasto.train.methods import (
    WHOLE_STEP,
    DataNeeds,
    MethodContext,
    Rows,
    StepOutput,
    register_method,
)

DRAFTP_SAMPLERS = ("euler", "ddim")
"""Samplers whose ladder splits at any step into a no-gradient prefix and gradient steps with
the same result: single-step and deterministic (a multistep solver's last steps would depend on
the prefix's estimates; an ancestral one's fresh noise would be redrawn when a checkpointed
step is recomputed)."""


def kl_penalty(tuned: Tensor, base: Tensor) -> Tensor:
    """mean((d_ft − d_base)²) over every element: NeMo-Aligner's
    ``calculate_gaussian_kl_penalty_shared_var`` (a shared-variance Gaussian KL, constants
    dropped) followed by the mean over the batch."""
    return (tuned.float() - base.float()).square().mean()


@dataclass(frozen=True)
class Trajectory:
    """The end of a truncated sampling run: the sampler's final state (differentiable through
    the gradient steps) and the KL term (mean over those steps)."""

    state: Tensor
    kl: Tensor


def gradient_step(
    plan: SamplingPlan,
    tuned: Denoiser,
    base: Denoiser,
    x: Tensor,
    index: int,
    checkpointed: bool,
) -> tuple[Tensor, Tensor]:
    """Sampler step ``index`` from ``x`` with gradients through ``tuned``; returns (the next
    state, the step's KL penalty against ``base`` evaluated without gradients at the same x).
    ``checkpointed``: keep only x and recompute the denoiser's activations in backward."""
    sigma, timestep = plan.sigmas[index], plan.timesteps[index]
    with torch.no_grad():
        base_denoised = base(x.detach(), sigma, timestep)

    def step(state: Tensor) -> tuple[Tensor, Tensor]:
        seen: dict[str, Tensor] = {}
        after = plan.sample(
            tuned, state, plan.sigmas[index : index + 2], plan.timesteps[index : index + 1],
            callback=lambda _, __, denoised: seen.setdefault("denoised", denoised),
        )  # fmt: skip
        return after, seen["denoised"]

    if checkpointed:
        x_next, denoised = checkpoint(step, x, use_reentrant=False)
    else:
        x_next, denoised = step(x)
    # d = (x − D)/σ for both models at the same x, so d_ft − d_base = (D_base − D_ft)/σ.
    return x_next, kl_penalty(denoised / sigma, base_denoised / sigma)


def truncated_sample(
    plan: SamplingPlan,
    tuned: Denoiser,
    base: Denoiser,
    x: Tensor,
    truncation_steps: int,
    checkpointed: bool = True,
    callback: StepCallback | None = None,
) -> Trajectory:
    """DRaFT-K: run the plan from ``x`` (its initial state) with no gradients until the last
    ``truncation_steps`` steps, then those with gradients through ``tuned``. ``callback`` sees
    the no-gradient prefix's states (as ``generate_latents``' callback does)."""
    num_steps = plan.timesteps.shape[0]
    first = num_steps - truncation_steps
    with torch.no_grad():
        x = plan.sample(
            tuned, x, plan.sigmas[: first + 1], plan.timesteps[:first], callback=callback
        )
    penalties = []
    for index in range(first, num_steps):
        x, penalty = gradient_step(plan, tuned, base, x, index, checkpointed)
        penalties.append(penalty)
    return Trajectory(x, torch.stack(penalties).mean())


def network(backbone: Backbone, autocast: Callable[[], AbstractContextManager]) -> Callable:
    """Sampling's ``model_forward`` (float32 output for the denoisers) under the run's
    autocast."""
    forward = model_forward(backbone)

    def autocast_forward(x_t: Tensor, timestep: Tensor, conditioning: Any) -> Tensor:
        with autocast():
            return forward(x_t, timestep, conditioning)

    return autocast_forward


def base_network(backbone: Backbone, autocast: Callable[[], AbstractContextManager]) -> Callable:
    """The base model's forward: the denoiser with its adapters disabled, or (full fine-tuning)
    a frozen copy of its starting weights, taken now (before any step or resume)."""
    denoiser = backbone.denoiser()
    if has_adapters(denoiser):
        return without_adapters(network(backbone, autocast), denoiser)
    frozen = copy.deepcopy(denoiser).requires_grad_(False).eval()
    return network(backbone.with_denoiser(frozen), autocast)


def pairwise_diversity(embeddings: Tensor, group_size: int) -> Tensor:
    """The mean pairwise distance between the L2-normalised embeddings ``[N, D]`` of each
    consecutive group of ``group_size`` rows (one prompt's images across seeds), averaged over
    the groups: 0 when a prompt always gives the same image, up to 2."""
    if group_size < 2:
        raise ValueError("diversity needs at least 2 images per prompt")
    groups = torch.nn.functional.normalize(embeddings.float(), dim=-1).unflatten(
        0, (-1, group_size)
    )
    distances = torch.cdist(groups, groups)  # [G, k, k]
    pairs = group_size * (group_size - 1)
    return (distances.sum(dim=(1, 2)) / pairs).mean()


class DraftpMethod:
    """DRaFT+ on the run's denoiser (see the module docstring)."""

    needs = DataNeeds.PROMPTS

    def __init__(self, context: MethodContext) -> None:
        config = context.config
        self.config, self.draftp = config, config.draftp
        self.backbone, self.autocast = context.backbone, context.autocast
        self.resolution = self.draftp.resolution or config.data.resolution
        options = model_sampling_options(config, self.draftp.spacing)
        plan = sampling_plan(
            SamplingRequest(
                sampler=self.draftp.sampler,
                num_steps=self.draftp.num_steps,
                prediction_type=options["prediction_type"],
                alphas_cumprod=options["alphas_cumprod"],
                spacing=options["spacing"],
                flow_shift=options["flow_shift"],
                flow_shift_resolution=options["flow_shift_resolution"],
                height=self.resolution,
                width=self.resolution,
            )
        )
        # a family that samples on its own ladder (OwnSampling: a released model's scheduler
        # shift, fixed or size-dependent) samples here as impasto sample and its pipeline do
        self.plan = family_plan(
            plan, context.backbone, options["prediction_type"], self.draftp.num_steps,
            self.resolution, self.resolution,
        )  # fmt: skip
        self.shape = context.backbone.latent_shape(self.resolution, self.resolution)
        self.tuned_network = network(context.backbone, context.autocast)
        self.base_network = base_network(context.backbone, context.autocast)
        self.reward: Reward = build_reward(config.reward, context.backbone.device)

    def denoisers(self, prompts: list[str]) -> tuple[Denoiser, Denoiser]:
        """(fine-tuned, base) denoisers for ``prompts`` with the run's guidance."""
        backbone, draftp, size = self.backbone, self.draftp, self.resolution
        with torch.no_grad():
            cond = backbone.sampling_condition(prompts, size, size)
            # a guidance-distilled model takes the scale as an input, without CFG
            cond, scale = embed_guidance(backbone, cond, draftp.guidance_scale)
            uncond_and_cond = None
            if scale != 1.0:
                negatives = [draftp.negative_prompt] * len(prompts)
                uncond_and_cond = backbone.sampling_condition(negatives, size, size).cat(cond)
        guidance = {"guidance_scale": scale}
        return (
            self.plan.make_denoiser(self.tuned_network, cond, uncond_and_cond, **guidance),
            self.plan.make_denoiser(self.base_network, cond, uncond_and_cond, **guidance),
        )

    def draw(self, generator: torch.Generator, rows: Rows, count: int) -> Tensor:
        """ε ``[count, C, h, w]`` for this micro-batch's rows of the step's global draw."""
        mine, total = rows.span(count)
        return torch.randn((total, *self.shape), generator=generator)[mine].to(self.backbone.device)

    def step(self, batch: Batch, generator: torch.Generator, rows: Rows = WHOLE_STEP) -> StepOutput:
        prompts = batch.captions
        tuned, base = self.denoisers(prompts)
        x = self.draw(generator, rows, len(prompts)) * self.plan.noise_scale
        if self.draftp.lv_samples:
            rewards, kl = self.low_variance_rewards(tuned, base, x, prompts, generator, rows)
        else:
            trajectory = truncated_sample(
                self.plan, tuned, base, x, self.draftp.truncation_steps,
                self.draftp.checkpoint_steps,
            )  # fmt: skip
            rewards, kl = self.score(trajectory.state, prompts), trajectory.kl
        loss = -rewards.mean() + self.draftp.kl_coeff * kl
        spread = rewards.std() if rewards.numel() > 1 else torch.zeros_like(kl)
        metrics = {"reward": rewards.mean().detach(), "reward_std": spread.detach()}
        return StepOutput(loss, metrics | {"kl": kl.detach()})

    def low_variance_rewards(
        self,
        tuned: Denoiser,
        base: Denoiser,
        x: Tensor,
        prompts: list[str],
        generator: torch.Generator,
        rows: Rows,
    ) -> tuple[Tensor, Tensor]:
        """DRaFT-LV: x0 from the whole chain without gradients, re-noised ``lv_samples`` times
        to the last step's level, each taken one step with gradients; (rewards of every
        re-noising ``[n·B]``, the mean KL)."""
        plan, last = self.plan, self.plan.timesteps.shape[0] - 1
        with torch.no_grad():
            x0 = plan.sample(tuned, x, plan.sigmas, plan.timesteps)
        rewards, penalties = [], []
        for _ in range(self.draftp.lv_samples):
            noisy = plan.noised(x0, plan.sigmas[last], self.draw(generator, rows, len(prompts)))
            state, penalty = gradient_step(
                plan, tuned, base, noisy, last, self.draftp.checkpoint_steps
            )
            rewards.append(self.score(state, prompts))
            penalties.append(penalty)
        return torch.cat(rewards), torch.stack(penalties).mean()

    def score(self, state: Tensor, prompts: list[str]) -> Tensor:
        """The reward ``[B]`` of the sampler's final state, decoded through the frozen (and
        differentiable) decoder."""
        latents = self.plan.to_latents(state)
        images = self.backbone.decode_images(latents, checkpointing=self.draftp.checkpoint_decoder)
        return self.reward(images, prompts).float()

    def validation_metrics(
        self, images: Tensor, prompts: list[str], images_per_prompt: int
    ) -> dict[str, float]:
        """The reward of the validation images (held-out prompts) and, with several images per
        prompt, their diversity in the reward's embedding (watching for reward hacking: a
        collapsing model draws one image per prompt)."""
        device = self.backbone.device
        with torch.no_grad():
            images = images.to(device)
            values = {"reward": self.reward(images, prompts).float().mean().item()}
            if images_per_prompt > 1:
                embedding = self.reward.embed(images)
                values["diversity"] = pairwise_diversity(embedding, images_per_prompt).item()
        return values

    def summarize(self, run_dir: Path) -> dict[str, Any] | None:
        """Write ``RUN/draftp-summary.json`` (reward against KL over the run, from
        ``metrics.jsonl``) and print its gist; None when the run logged no JSONL metrics."""
        summary = reward_summary(run_dir / METRICS_FILE)
        if summary is None:
            return None
        path = run_dir / SUMMARY_FILE
        with writing(path):
            path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        print(f"impasto: draftp: {describe(summary)} ({path})")
        return summary


SUMMARY_FILE = "draftp-summary.json"


def reward_summary(metrics_file: Path, window: float = 0.1) -> dict[str, Any] | None:
    """The run's reward and KL at its start and end (means over the first and last ``window``
    of its logged steps) and every validation round's held-out reward and diversity."""
    if not metrics_file.is_file():
        return None
    rows = [json.loads(line) for line in metrics_file.read_text(encoding="utf-8").splitlines()]
    train = [row for row in rows if "reward" in row and "kl" in row]
    if not train:
        return None
    size = max(1, round(len(train) * window))

    def mean_of(part: list[dict[str, Any]]) -> dict[str, float]:
        return {name: statistics.fmean(row[name] for row in part) for name in ("reward", "kl")}

    validation = [
        {"step": row["step"], "reward": row["val/reward"], "diversity": row.get("val/diversity")}
        for row in rows
        if "val/reward" in row
    ]
    return {
        "train": {
            "first": {
                "steps": [train[0]["step"], train[size - 1]["step"]],
                **mean_of(train[:size]),
            },
            "last": {"steps": [train[-size]["step"], train[-1]["step"]], **mean_of(train[-size:])},
            "max_kl": max(row["kl"] for row in train),
        },
        "validation": validation,
    }


def describe(summary: dict[str, Any]) -> str:
    """One line: reward and KL from the start to the end, and the held-out reward."""
    first, last = summary["train"]["first"], summary["train"]["last"]
    text = (
        f"reward {first['reward']:.3f} -> {last['reward']:.3f}, "
        f"KL {first['kl']:.4f} -> {last['kl']:.4f}"
    )
    validation = summary["validation"]
    if validation:
        text += f"; held-out reward {validation[0]['reward']:.3f} -> {validation[-1]['reward']:.3f}"
        if validation[0]["diversity"] is not None:
            text += (
                f", diversity {validation[0]['diversity']:.3f} -> {validation[-1]['diversity']:.3f}"
            )
    return text


register_method("draftp")(DraftpMethod)
