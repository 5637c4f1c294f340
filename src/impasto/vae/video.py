"""``python -m impasto.vae.video --out DIR ...``: train the demo video VAE (issue #32).

Argument parsing for :func:`impasto.vae.video_train.train_video_vae`; the clips are made in
memory by the video demo's generator, so there is no data folder. Building the parser imports no
torch; the trainer is imported when the command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from impasto.vae.settings import VideoVaeTrainSettings

EXIT_USAGE = 2


def add_train_video_vae_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--out DIR [--steps N] [--batch-pixels P] [--seed S] ...`` to ``parser``."""
    defaults = VideoVaeTrainSettings()
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for config.json and the safetensors"
    )
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument(
        "--batch-pixels",
        type=int,
        default=defaults.batch_pixels,
        help="frames x height x width per step (default: one 17-frame clip of 64 px)",
    )
    parser.add_argument(
        "--image-steps",
        type=int,
        default=defaults.image_steps,
        help="the first steps train on images only, then on clips and images",
    )
    parser.add_argument(
        "--crop", type=int, default=defaults.crop, help="train on random squares of this side"
    )
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument("--loss", default=defaults.loss, help="mse or l1")
    parser.add_argument("--kl-weight", type=float, default=defaults.kl_weight)
    parser.add_argument("--max-grad-norm", type=float, default=defaults.max_grad_norm)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--init", default=defaults.init, help="a video VAE folder to fine-tune (default: fresh)"
    )
    parser.add_argument("--dtype", default="float16", help="saved weights: float16 or float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--log-every", type=int, default=100, help="steps between loss lines")


def cmd_train_video_vae(args: argparse.Namespace) -> int:
    """Run the command from parsed arguments; print progress and a summary."""
    from impasto.vae.video_train import train_video_vae

    report = train_video_vae(
        args.out,
        steps=args.steps,
        batch_pixels=args.batch_pixels,
        image_steps=args.image_steps,
        crop=args.crop,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        loss=args.loss,
        kl_weight=args.kl_weight,
        max_grad_norm=args.max_grad_norm,
        seed=args.seed,
        init=args.init,
        dtype=args.dtype,
        device=args.device,
        log_every=args.log_every,
        log=print,
    )
    print(report.summary())
    return 0


def main_train_video_vae(argv: Sequence[str] | None = None) -> int:
    """The command as a program; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m impasto.vae.video",
        description="Train the demo video VAE (Wan 2.1's AutoencoderKLWan, tiny) on the video "
        "demo's moving shapes.",
    )
    add_train_video_vae_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_train_video_vae(args)
    except ValueError as error:
        if os.environ.get("IMPASTO_DEBUG"):
            raise
        print(f"impasto: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main_train_video_vae())
