"""The ``objective`` section: the diffusion objective of a run (docs/objectives.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from impasto.config.section import MAX_RESOLUTION, Float, Int, Section

FLOW = "flow"  # the prediction type of rectified flow (SD3 convention)
MAX_TIMESTEPS = 10_000  # DDPM timesteps T (SDXL: 1000); keeps an absurd value from torch


class TimestepBiasConfig(Section):
    """diffusers' timestep bias (DESIGN §5): P(t) ∝ multiplier on the biased steps, 1 elsewhere."""

    strategy: Literal["none", "earlier", "later", "range"] = "none"
    multiplier: Float = Field(1.0, description="must be > 0")
    begin: Int = Field(0, ge=0, le=MAX_TIMESTEPS, description="range only")
    end: Int | None = Field(
        None, ge=1, le=MAX_TIMESTEPS, description="range only, exclusive; default T"
    )
    portion: Float = Field(0.25, gt=0, le=1, description="earlier / later: this fraction of T")


class ObjectiveConfig(Section):
    """The diffusion objective; each name is a registry key of :mod:`impasto.objectives`."""

    method: str = Field(
        "denoise", description="the training method (impasto.train.methods.METHODS)"
    )
    schedule: str = "scaled_linear"
    num_train_timesteps: Int = Field(1000, ge=2, le=MAX_TIMESTEPS)
    beta_start: Float = Field(0.00085, gt=0, lt=1)
    beta_end: Float = Field(0.012, gt=0, lt=1)
    zero_terminal_snr: bool = Field(False, description="Lin et al. 2023; needs v_prediction")
    terminal_sigma: Float = Field(
        20000.0, gt=0, le=1e8, description="stands in for ZTSNR's infinite σ"
    )
    prediction_type: str = Field(
        "epsilon", description="epsilon, v_prediction, sample (x0) or flow (rectified flow)"
    )
    timestep_sampling: str = Field(
        "uniform",
        description="DDPM: uniform, timestep_bias; flow: uniform, logit_normal, mode, cosmap",
    )
    min_timestep: Int = Field(0, ge=0, le=MAX_TIMESTEPS, description="uniform: lowest t")
    max_timestep: Int | None = Field(
        None, ge=1, le=MAX_TIMESTEPS, description="uniform: exclusive; default T"
    )
    timestep_bias: TimestepBiasConfig = Field(default_factory=TimestepBiasConfig)
    loss_weighting: str = "none"
    min_snr_gamma: Float = Field(5.0, gt=0)
    p2_gamma: Float = Field(1.0, gt=0)
    noise_offset: Float = Field(0.0, ge=0, description="Guttenberg 2023; kohya suggests 0.1")
    noise_offset_random_strength: bool = False
    multires_noise_iterations: Int = Field(
        0, ge=0, le=32, description="0: off; kohya suggests 6-10"
    )
    multires_noise_discount: Float = Field(0.3, gt=0, le=1)
    input_perturbation: Float = Field(0.0, ge=0, description="Ning et al. 2023; 0.1 suggested")
    input_perturbation_random_strength: bool = False
    loss: str = "mse"
    huber_schedule: str = "snr"
    huber_c: Float = Field(0.1, gt=0, le=1)
    logit_mean: Float = Field(0.0, description="flow, logit_normal: mean of logit(t)")
    logit_std: Float = Field(1.0, gt=0, description="flow, logit_normal: std of logit(t)")
    mode_scale: Float = Field(1.29, description="flow, mode: in [-1, 1.75]")
    flow_shift: Float = Field(
        1.0, gt=0, description="flow: t → s·t/(1 + (s − 1)·t), s > 1 towards noise; SD3: 3 at 1024²"
    )
    precondition_outputs: bool = Field(
        False,
        description="flow: the loss on x0 = x_t − t·v against the clean latents, as diffusers' "
        "train_dreambooth_lora_sd3.py --precondition_outputs 1 (its default); false: on v",
    )
    flow_shift_resolution: Int | None = Field(
        None,
        ge=8,
        le=MAX_RESOLUTION,
        description="flow: flow_shift holds at this side; other sizes scale it by "
        "sqrt(H·W)/flow_shift_resolution (Esser et al. 2024); null: the same shift at every size",
    )

    @property
    def is_flow(self) -> bool:
        """Rectified flow (continuous t in (0, 1]) rather than a DDPM objective (integer t)."""
        return self.prediction_type == FLOW

    @model_validator(mode="after")
    def _valid_combination(self) -> ObjectiveConfig:
        flow = self.is_flow
        if self.beta_end <= self.beta_start:
            raise ValueError(
                f"beta_end must be > beta_start, got {self.beta_end} <= {self.beta_start}"
            )
        if self.zero_terminal_snr and self.prediction_type != "v_prediction":
            raise ValueError(
                "zero_terminal_snr needs prediction_type: v_prediction (at SNR 0 the noise is "
                f"the input itself, nothing to predict), got {self.prediction_type!r}"
            )
        T = self.num_train_timesteps
        if not self.min_timestep < (self.max_timestep or T) <= T:
            raise ValueError(
                f"need 0 <= min_timestep < max_timestep <= {T}, got "
                f"{self.min_timestep} and {self.max_timestep}"
            )
        bias = self.timestep_bias
        if bias.multiplier <= 0:
            raise ValueError(f"timestep_bias.multiplier must be > 0, got {bias.multiplier}")
        if bias.strategy == "range" and not bias.begin < (bias.end or T) <= T:
            raise ValueError(
                f"timestep_bias: need begin < end <= {T}, got {bias.begin} and {bias.end}"
            )
        # Options of the other family must stay at their defaults (a dumped config has them all).
        ddpm_only = ("min_timestep", "max_timestep", "timestep_bias")
        flow_only = ("flow_shift", "flow_shift_resolution", "precondition_outputs")
        for field in ddpm_only if flow else flow_only:
            if getattr(self, field) != type(self).model_fields[field].get_default(
                call_default_factory=True
            ):
                other = "DDPM objectives (epsilon, v_prediction, sample)" if flow else "flow"
                raise ValueError(
                    f"{field} applies to {other} only, not prediction_type "
                    f"{self.prediction_type}; remove it"
                )
        return self

    def timestep_sampler_params(self) -> dict:
        """Keyword arguments of ``TIMESTEP_SAMPLERS`` (flow: ``FLOW_TIME_SAMPLERS``) entries."""
        if self.is_flow:
            return {
                "logit_normal": {"mean": self.logit_mean, "std": self.logit_std},
                "mode": {"scale": self.mode_scale},
            }.get(self.timestep_sampling, {})
        if self.timestep_sampling == "timestep_bias":
            return self.timestep_bias.model_dump()
        return {"min_timestep": self.min_timestep, "max_timestep": self.max_timestep}

    def loss_weighting_params(self) -> dict:
        """Keyword arguments of ``LOSS_WEIGHTINGS[loss_weighting]``."""
        return {"min_snr": {"gamma": self.min_snr_gamma}, "p2": {"gamma": self.p2_gamma}}.get(
            self.loss_weighting, {}
        )
