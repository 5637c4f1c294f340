"""``impasto inspect objective``: the schedule, sampling probability and loss weight per timestep.

Users ask to see their schedule; this also makes every objective choice checkable. Rows are
computed by the same registry functions the train step uses.
"""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw

from impasto.config.schema import ObjectiveConfig
from impasto.objectives import (
    LOSS_WEIGHTINGS,
    TIMESTEP_PROBABILITIES,
    sigmas_from_alphas_cumprod,
    snr_from_alphas_cumprod,
    training_alphas_cumprod,
)

COLUMNS = ("t", "sigma", "snr", "prob", "weight")


def objective_rows(objective: ObjectiveConfig) -> list[dict[str, float]]:
    """One row per training timestep: t, σ_t, SNR_t, P(t) and the loss weight at t."""
    alphas_cumprod = training_alphas_cumprod(objective)
    num_steps = alphas_cumprod.shape[0]
    sigmas = sigmas_from_alphas_cumprod(alphas_cumprod)
    snr = snr_from_alphas_cumprod(alphas_cumprod)
    probabilities = TIMESTEP_PROBABILITIES[objective.timestep_sampling](
        num_steps, **objective.timestep_sampler_params()
    )
    weights = LOSS_WEIGHTINGS[objective.loss_weighting](
        snr, objective.prediction_type, **objective.loss_weighting_params()
    )
    return [
        {
            "t": t,
            "sigma": sigmas[t].item(),
            "snr": snr[t].item(),
            "prob": probabilities[t].item(),
            "weight": weights[t].item(),
        }
        for t in range(num_steps)
    ]


def format_rows(rows: list[dict[str, float]]) -> str:
    """A fixed-width table with a header line."""
    lines = [f"{'t':>5} {'sigma':>12} {'snr':>12} {'prob':>12} {'weight':>12}"]
    for row in rows:
        lines.append(
            f"{row['t']:>5} {row['sigma']:>12.6g} {row['snr']:>12.6g} "
            f"{row['prob']:>12.6g} {row['weight']:>12.6g}"
        )
    return "\n".join(lines)


PANEL_WIDTH, PANEL_HEIGHT, MARGIN = 640, 140, 40


def plot_rows(rows: list[dict[str, float]], path: str | Path) -> Path:
    """Four stacked panels over t: log10 σ, log10 SNR, P(t), weight. Written as a PNG."""
    panels = [
        ("log10 sigma", [math.log10(r["sigma"]) for r in rows]),
        ("log10 snr", [math.log10(max(r["snr"], 1e-30)) for r in rows]),
        ("prob", [r["prob"] for r in rows]),
        ("weight", [r["weight"] for r in rows]),
    ]
    width, height = PANEL_WIDTH + 2 * MARGIN, len(panels) * (PANEL_HEIGHT + MARGIN) + MARGIN
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    last_t = max(len(rows) - 1, 1)
    for index, (title, values) in enumerate(panels):
        top = MARGIN + index * (PANEL_HEIGHT + MARGIN)
        low, high = min(values), max(values)
        if high == low:  # a constant curve sits mid-panel
            low, high = low - 1.0, high + 1.0
        span = high - low
        draw.rectangle([MARGIN, top, MARGIN + PANEL_WIDTH, top + PANEL_HEIGHT], outline="gray")
        draw.text((MARGIN, top - 14), f"{title}  [{low:.4g}, {high:.4g}]", fill="black")
        points = [
            (
                MARGIN + PANEL_WIDTH * t / last_t,
                top + PANEL_HEIGHT * (1 - (value - low) / span),
            )
            for t, value in enumerate(values)
        ]
        draw.line(points, fill=(30, 90, 200), width=2)
    draw.text((MARGIN, height - 16), f"t = 0 ... {last_t}", fill="black")
    path = Path(path)
    image.save(path)
    return path
