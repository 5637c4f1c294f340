"""Sampling Wan 2.1 as ``WanPipeline`` does: UniPC (impasto's ``unipc`` flow sampler, equal to
diffusers' ``UniPCMultistepScheduler``) on the ladder of the model's scheduler config (Wan2.1's:
flow sigmas shifted by ``flow_shift`` 3.0; 5.0 for 720p), classifier-free guidance on the
velocity with the negative prompt (``""`` by default; Wan's recommended one is long,
docs/wan.md): ``v_u + g·(v_c − v_u)`` for g > 1.

The backbone names UniPC as its own sampler (``own_sampler``) and the ladder as its own
(``sampling_ladder``: :func:`wan_ladder`), so ``impasto sample`` and validation clips, which
call :mod:`impasto.sampling`'s generic sampler, sample as the pipeline does unless another
sampler (``euler``) is asked by name; :func:`generate_wan` is that sampler with the
pipeline's defaults.
"""

from __future__ import annotations

from torch import Tensor

from impasto.models.wan.backbone import WanBackbone
from impasto.sampling.generate import eval_mode, generate_latents

DEFAULT_STEPS = 50  # WanPipeline's defaults
DEFAULT_GUIDANCE = 5.0

# the UniPC impasto's "unipc" flow sampler is (impasto.sampling.unipc): a scheduler config
# with other values samples otherwise, so the family does not call it its own
UNIPC_SOLVER = {
    "prediction_type": "flow_prediction", "use_flow_sigmas": True, "solver_order": 2,
    "solver_type": "bh2", "predict_x0": True, "lower_order_final": True,
    "disable_corrector": [], "thresholding": False,
}  # fmt: skip


def own_sampler(backbone: WanBackbone) -> str:
    """``"unipc"``: WanPipeline's ``UniPCMultistepScheduler``, once its config is checked to be
    the variant impasto's sampler implements (a one-line error otherwise)."""
    config = backbone.components.scheduler().config
    for key, value in UNIPC_SOLVER.items():
        if config.get(key) != value:
            raise ValueError(
                f"the model's scheduler config sets {key}={config.get(key)!r}; impasto's unipc "
                f"sampler is UniPC with {key}={value!r}: ask for --sampler euler (sample.sampler)"
            )
    return "unipc"


def wan_ladder(backbone: WanBackbone, num_steps: int) -> tuple[Tensor, Tensor]:
    """``(timesteps [n], ts [n + 1])`` float32: the transformer's time input t·T, and t ending
    at 0 (WanPipeline's scheduler's)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    scheduler = backbone.components.scheduler()
    scheduler.set_timesteps(num_steps)
    return scheduler.timesteps.float(), scheduler.sigmas.float()


def generate_wan_latents(
    backbone: WanBackbone,
    prompts: list[str],
    *,
    negative_prompt: str = "",
    num_videos_per_prompt: int = 1,
    num_steps: int = DEFAULT_STEPS,
    guidance_scale: float = DEFAULT_GUIDANCE,
    seed: int = 0,
    height: int = 480,
    width: int = 832,
    frames: int = 81,
    sampler: str | None = None,
) -> Tensor:
    """Latents ``[B·k, 16, 1 + (frames − 1)/4, H/8, W/8]`` float32 on the model's device (not
    unscaled), rows prompt-major; row j starts from the noise of seed + j (``WanPipeline``
    called with ``generator=[torch.Generator().manual_seed(seed + j) ...]``): impasto's
    sampler with WanPipeline's defaults, UniPC unless ``sampler`` names another."""
    return generate_latents(
        backbone, prompts, negative_prompt=negative_prompt,
        num_images_per_prompt=num_videos_per_prompt, num_steps=num_steps,
        guidance_scale=guidance_scale, sampler=sampler, seed=seed, height=height, width=width,
        frames=frames, prediction_type="flow",
    )  # fmt: skip


def generate_wan(backbone: WanBackbone, prompts: list[str], **options: object) -> Tensor:
    """Clips ``[B·k, 3, frames, H, W]`` float32 on the CPU in [0, 1]:
    :func:`generate_wan_latents`, decoded by the VAE (WanPipeline's latent map undone)."""
    latents = generate_wan_latents(backbone, prompts, **options)
    with eval_mode(*backbone.modules().values()):
        return backbone.decode_latents(latents)
