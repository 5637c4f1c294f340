"""``impasto inspect objective``: the schedule, sampling probability and loss weight per timestep.

Users ask to see their schedule; this also makes every objective choice checkable. Rows are
computed by the same registry functions the train step uses.
"""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw

from impasto.config.objective import ObjectiveConfig
from impasto.objectives.objective import Objective

COLUMNS = ("t", "sigma", "snr", "prob", "weight")


def objective_rows(
    objective: ObjectiveConfig, image_size: tuple[int, int] | None = None
) -> list[dict[str, float]]:
    """One row per training timestep (flow: per point of a grid of T midpoints in (0, 1)).

    Columns: t; σ, the VE noise level 1/sqrt(SNR) (for flow t/(1 − t), not diffusers' flow
    "sigma", which is t itself); SNR; the sampling probability P(t) (for flow the density of the
    shifted t, at ``image_size`` (H, W) when ``flow_shift_resolution`` is set); the loss weight.
    """
    process = Objective.from_config(objective).process
    times = process.grid_times()
    probabilities = process.time_probabilities(times, image_size)
    snr, sigmas = process.snr(times), process.sigmas(times)
    weights = process.loss_weights(times)
    return [
        {
            "t": times[i].item(),
            "sigma": sigmas[i].item(),
            "snr": snr[i].item(),
            "prob": probabilities[i].item(),
            "weight": weights[i].item(),
        }
        for i in range(times.shape[0])
    ]


def format_rows(rows: list[dict[str, float]]) -> str:
    """A fixed-width table with a header line."""
    lines = [f"{'t':>5} {'sigma':>12} {'snr':>12} {'prob':>12} {'weight':>12}"]
    for row in rows:
        lines.append(
            f"{row['t']:>5.4g} {row['sigma']:>12.6g} {row['snr']:>12.6g} "
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
    last_index = max(len(rows) - 1, 1)
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
                MARGIN + PANEL_WIDTH * index / last_index,
                top + PANEL_HEIGHT * (1 - (value - low) / span),
            )
            for index, value in enumerate(values)
        ]
        draw.line(points, fill=(30, 90, 200), width=2)
    first_t, last_t = rows[0]["t"], rows[-1]["t"]
    draw.text((MARGIN, height - 16), f"t = {first_t:.4g} ... {last_t:.4g}", fill="black")
    path = Path(path)
    image.save(path)
    return path
