"""``impasto train-vae``: argument parsing for :func:`impasto.vae.train.train_vae`.

The main ``impasto`` parser adds the subcommand with :func:`add_train_vae_arguments` and
:func:`cmd_train_vae`; ``python -m impasto.vae`` runs the same command on its own. Building the
parser imports no torch; :func:`cmd_train_vae` imports the trainer when the command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from impasto.vae.settings import VaeTrainSettings

EXIT_USAGE = 2


def add_train_vae_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``DATA_DIR --out FILE [--steps N] [--resolution R] [--seed S] ...`` to ``parser``."""
    defaults = VaeTrainSettings()
    parser.add_argument("data_dir", type=Path, help="image folder to train on")
    parser.add_argument(
        "--out", type=Path, required=True, help=".safetensors file (config.json goes beside it)"
    )
    parser.add_argument(
        "--held-out",
        type=Path,
        default=None,
        help="folder of evaluation images (default: the last 5%%, at most 64, of DATA_DIR)",
    )
    parser.add_argument("--resolution", type=int, default=defaults.resolution)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument("--loss", default=defaults.loss, help="mse or l1")
    parser.add_argument("--kl-weight", type=float, default=defaults.kl_weight)
    parser.add_argument("--max-grad-norm", type=float, default=defaults.max_grad_norm)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--log-every", type=int, default=100, help="steps between loss lines")


def cmd_train_vae(args: argparse.Namespace) -> int:
    """Run ``impasto train-vae`` from parsed arguments; print progress and a summary."""
    from impasto.vae.train import train_vae

    report = train_vae(
        args.data_dir,
        args.out,
        resolution=args.resolution,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        held_out=args.held_out,
        warmup_steps=args.warmup_steps,
        loss=args.loss,
        kl_weight=args.kl_weight,
        max_grad_norm=args.max_grad_norm,
        device=args.device,
        log_every=args.log_every,
        log=print,
    )
    print(report.summary())
    return 0


def main_train_vae(argv: Sequence[str] | None = None) -> int:
    """``impasto train-vae`` as a stand-alone program; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="impasto train-vae", description="Train the tiny demo VAE on an image folder."
    )
    add_train_vae_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_train_vae(args)
    except ValueError as error:
        if os.environ.get("IMPASTO_DEBUG"):
            raise
        print(f"impasto: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return EXIT_USAGE
