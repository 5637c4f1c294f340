"""The ``impasto`` command line: argument parsing only; every command calls the Python API.

User mistakes (bad config, missing files, unreadable data) print one line each and exit with
code 2. A config is checked in two passes (:func:`impasto.api.load_config`): its structure, which
needs no torch, so a bad key is reported in well under a second, then the names that select code.
Library notices a user cannot act on are hidden; set ``IMPASTO_DEBUG=1`` to see them and to see
the traceback of an error instead of its line.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from impasto.config import Config

EXIT_USAGE = 2

# Library log records about choices impasto makes, not the user, dropped unless IMPASTO_DEBUG=1:
# diffusers warns on every `module.to(dtype)` (impasto casts the VAE and exports itself), and
# transformers notes that an image processor diffusers imports lacks torchvision (none is used).
UNACTIONABLE_LOGGERS = ("diffusers.models.modeling_utils", "transformers.utils.import_utils")
UNACTIONABLE_MESSAGES = ("that should be kept in float32", "requires torchvision (not installed)")


Subcommands = argparse._SubParsersAction  # what add_subparsers returns


def _debug() -> bool:
    return bool(os.environ.get("IMPASTO_DEBUG"))


def _load_config(args: argparse.Namespace) -> Config:
    from impasto.api import load_config

    return load_config(args.config, args.set or [])


def cmd_train(args: argparse.Namespace) -> int:
    from impasto.config import config_to_yaml

    config = _load_config(args)
    if args.print_config:
        print(config_to_yaml(config), end="")
        return 0
    _quiet_progress_bars()
    from impasto.runs import summarize_run
    from impasto.train import train

    result = train(
        config, resume=not args.no_resume, run_summary=lambda run: summarize_run(run).lines()
    )
    from impasto.train.signals import EXIT_INTERRUPTED

    return EXIT_INTERRUPTED if result.interrupted else 0


def cmd_cache(args: argparse.Namespace) -> int:
    config = _load_config(args)
    _quiet_progress_bars()
    from impasto.data.pipeline import cache_data

    report = cache_data(config)
    print(f"impasto: {report.format()}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import json

    from impasto.bench import check_report_file, format_report, run_bench

    _quiet_progress_bars()
    json_file = check_report_file(args.json_file)  # before the minutes of timing, not after
    report = run_bench(
        model=args.model,
        resolution=args.resolution,
        batch=args.batch,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        precision=args.precision,
        variants=args.variants,
        device=args.device,
        overrides=args.set or [],
        parallel=args.parallel,
        nproc=args.nproc,
        estimate=args.estimate,
        frames=args.frames,
    )
    if report is not None:  # None: a rank other than 0 of a parallel bench
        if json_file is not None:
            json_file.write_text(json.dumps(report) + "\n", encoding="utf-8")
        print(json.dumps(report) if args.json else format_report(report))
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from impasto.inference import SampleRequest, sample_checkpoint

    _quiet_progress_bars()
    request = SampleRequest(
        prompts=tuple(args.prompt or ()),
        prompts_file=args.prompts_file,
        negative_prompt=args.negative,
        num_images=args.num,
        batch_size=args.batch_size,
        captions=args.captions,
        seed=args.seed,
        num_steps=args.steps,
        guidance_scale=args.cfg,
        guidance_rescale=args.guidance_rescale,
        sampler=args.sampler,
        spacing=args.spacing,
        size=args.size,
        ema=args.ema,
        anneal=args.anneal,
        frames=args.frames,
        formats=tuple(args.format or ()),
    )
    for path in sample_checkpoint(args.checkpoint, request, args.out):
        print(path)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from impasto.export import ExportOptions, export_checkpoint

    _quiet_progress_bars()
    options = ExportOptions(
        args.dtype, args.merge, args.merge_lora, args.lora_scale, args.ema, verbose=args.verbose
    )
    print(export_checkpoint(args.checkpoint, args.format, args.out, options))
    return 0


def cmd_data_demo(args: argparse.Namespace) -> int:
    from impasto.data.demo_datasets import IMAGE_OPTIONS, VIDEO_OPTIONS, write_demo

    given = {key: getattr(args, key) for key in (*IMAGE_OPTIONS, *VIDEO_OPTIONS)}
    print(write_demo(Path(args.out_dir), args.video, args.size, args.seed, **given))
    return 0


def cmd_data_preview(args: argparse.Namespace) -> int:
    config = _load_config(args)
    from impasto.data.preview import preview_sheet

    path = preview_sheet(config, args.out, args.num)
    print(f"impasto: wrote {path}")
    return 0


def cmd_runs_list(args: argparse.Namespace) -> int:
    from impasto.runs import list_runs

    print("\n".join(list_runs(args.dir)))
    return 0


def cmd_runs_summary(args: argparse.Namespace) -> int:
    from impasto.runs import summarize_run

    print("\n".join(summarize_run(args.run_dir).lines()))
    return 0


def cmd_runs_plot(args: argparse.Namespace) -> int:
    from impasto.runs import plot_runs

    print(f"impasto: wrote {plot_runs(args.run_dirs, args.out)}")
    return 0


def cmd_inspect_objective(args: argparse.Namespace) -> int:
    import json

    config = _load_config(args)
    from impasto.inspect_objective import format_rows, objective_rows, plot_rows

    size = config.data.resolution
    rows = objective_rows(config.objective, image_size=(size, size))
    print(json.dumps(rows) if args.json else format_rows(rows))
    if args.plot:
        print(f"impasto: plot written to {plot_rows(rows, args.plot)}", file=sys.stderr)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from impasto.doctor import environment_report

    print(environment_report())
    return 0


def _add_train(sub: Subcommands) -> None:
    """`impasto train CONFIG`: train or resume a run."""
    train = sub.add_parser("train", help="train or resume the run of a config file")
    train.add_argument("config", help="YAML config file")
    train.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set optim.lr=1e-4 (repeatable)",
    )
    train.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    train.add_argument(
        "--no-resume",
        action="store_true",
        help="start over; earlier checkpoints move to RUN/previous-<time>/",
    )
    train.set_defaults(func=cmd_train)


def _add_data(sub: Subcommands) -> None:
    """`impasto data demo|preview`: dataset tools."""
    data = sub.add_parser("data", help="dataset tools").add_subparsers(
        dest="data_command", required=True
    )
    demo = data.add_parser("demo", help="write the built-in demo dataset (coloured shapes)")
    demo.add_argument("out_dir")
    demo.add_argument("--num-images", type=int, help="images to write (default 16)")
    demo.add_argument("--size", type=int, default=64, help="side in pixels (default 64)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--video", action="store_true", help="write clips of moving shapes (docs/video.md)"
    )
    demo.add_argument("--num-clips", type=int, help="with --video: clips to write (default 16)")
    demo.add_argument("--frames", type=int, help="with --video: frames per clip, 9-17 (default 9)")
    demo.add_argument(
        "--format",
        dest="fmt",
        metavar="{frames,mp4}",
        help="with --video: a folder of PNGs per clip (default, lossless) or an H.264 .mp4",
    )
    demo.add_argument("--held-out", action="store_true", default=None, help="with --video: "
                      "clips of the combinations training never shows")  # fmt: skip
    demo.add_argument("--num-stills", type=int, help="with --video: the image demo's "
                      "images, one-frame samples beside the clips (default 0)")  # fmt: skip
    demo.set_defaults(func=cmd_data_demo)
    preview = data.add_parser(
        "preview", help="a contact sheet of the first training examples, as the model sees them"
    )
    preview.add_argument("config", help="YAML config file")
    preview.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)"
    )
    preview.add_argument("--out", required=True, help="the PNG to write")
    preview.add_argument("--num", type=int, default=16, help="examples to show (default 16)")
    preview.set_defaults(func=cmd_data_preview)


def _add_sample(sub: Subcommands) -> None:
    """`impasto sample CHECKPOINT`: generate images, or a video model's clips."""
    sample = sub.add_parser(
        "sample",
        help="generate images (or clips) from a run, a checkpoint or an exported SDXL model",
        description="Options left out take the run's sample.* values (for an exported model "
        "their defaults, and its own size); a prompt file's per-line options override both.",
    )
    sample.add_argument(
        "checkpoint",
        help="RUN directory (newest checkpoint), RUN/checkpoints/step-N, an exported "
        "single-file .safetensors or a diffusers SDXL folder",
    )
    sample.add_argument(
        "--prompt",
        action="append",
        help="repeatable; with neither --prompt nor --prompts-file, a run's validation prompts "
        "with the seeds of its grid",
    )
    sample.add_argument(
        "--prompts-file",
        metavar="FILE",
        help="one prompt per line, after the --prompt ones; kohya's per-line options --n "
        "NEGATIVE --w W --h H --s STEPS --d SEED --l CFG; '#' starts a comment line",
    )
    sample.add_argument("--negative", help="negative prompt (default: sample.negative_prompt)")
    sample.add_argument(
        "--num",
        type=int,
        help="images per prompt (seeds seed, seed+1, ...); default 1, or with no --prompt the "
        "run's sample.images_per_prompt",
    )
    sample.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="images generated at once (default 1); written as each batch is done",
    )
    sample.add_argument(
        "--captions",
        action="store_true",
        help="write each image's prompt beside it as NAME.txt (e.g. DreamBooth class images)",
    )
    sample.add_argument("--seed", type=int, help="default: sample.seed")
    sample.add_argument("--steps", type=int, help="default: sample.num_steps")
    sample.add_argument(
        "--cfg", type=float, help="classifier-free guidance scale (default: sample.guidance_scale)"
    )
    sample.add_argument(
        "--guidance-rescale",
        type=float,
        metavar="PHI",
        help="guidance rescale phi in [0, 1] (Lin et al. 2023; default: sample.guidance_rescale)",
    )
    sample.add_argument("--ema", action="store_true", help="sample with the EMA weights")
    sample.add_argument(
        "--sampler",
        help="euler, euler_ancestral, ddim, dpmpp_2m, dpmpp_2m_karras, unipc (flow models: "
        "euler, unipc); default: sample.sampler, else the family's own (Wan: unipc; euler)",
    )
    sample.add_argument(
        "--spacing",
        choices=("leading", "trailing", "linspace"),
        help="timestep spacing (default: the run's sample.spacing, or a diffusers folder's "
        "scheduler's; trailing with zero terminal SNR, else leading)",
    )
    sample.add_argument(
        "--size",
        type=int,
        help="square side in pixels (default: sample.resolution, else data.resolution; an "
        "exported model's modelspec.resolution, else 1024 for SDXL)",
    )
    sample.add_argument(
        "--anneal",
        metavar="SPEC",
        help="annealed guidance: at step i of n mix (1 - w)·base + w·fine-tuned, w from "
        "base (0) | draft (1) | linear (i/n) | power_P ((i/n)^P) | step_F (1 once i/n >= F); "
        "the base is the run's model with its LoRA off, or its starting model",
    )
    sample.add_argument("--frames", type=int, metavar="N", help="a video model's clips of N = "
                        "k·4+1 frames, each as NAME.mp4, NAME.webp and NAME.png (its frames); "
                        "default: sample.frames, else images")  # fmt: skip
    sample.add_argument("--format", action="append", metavar="FMT", help="clip files, "
                        "repeatable: mp4, webp, gif (default: mp4, webp)")  # fmt: skip
    sample.add_argument("--out", required=True, help="output folder")
    sample.set_defaults(func=cmd_sample)


def _add_train_vae(sub: Subcommands) -> None:
    """`impasto train-vae`: the tiny demo VAE."""
    from impasto.vae.cli import add_train_vae_arguments, cmd_train_vae

    train_vae = sub.add_parser("train-vae", help="train the tiny demo VAE on an image folder")
    add_train_vae_arguments(train_vae)
    train_vae.set_defaults(func=cmd_train_vae)


def _add_inspect(sub: Subcommands) -> None:
    """`impasto inspect objective CONFIG`: what a config's objective does per timestep."""
    inspect = sub.add_parser("inspect", help="show what a config does")
    inspect_sub = inspect.add_subparsers(dest="what", required=True)
    objective = inspect_sub.add_parser(
        "objective", help="per timestep: t, sigma, SNR, sampling probability, loss weight"
    )
    objective.add_argument("config", help="YAML config file")
    objective.add_argument("--set", action="append", metavar="KEY=VALUE", help="override")
    objective.add_argument("--json", action="store_true", help="a JSON list of row objects")
    objective.add_argument("--plot", metavar="FILE.png", help="also draw the curves")
    objective.set_defaults(func=cmd_inspect_objective)


def _add_export(sub: Subcommands) -> None:
    """`impasto export CHECKPOINT`: formats other tools load."""
    export = sub.add_parser("export", help="write a checkpoint in a format other tools load")
    export.add_argument("checkpoint", help="a run directory or RUN/checkpoints/step-XXXXXXXX")
    export.add_argument(
        "--format",
        required=True,
        help="a format of the run's model family: diffusers | single-file | lora-kohya | "
        "lora-diffusers (SDXL and the released transformer families; some: lora-comfyui), "
        "folder (our diffusion transformer); docs/formats.md",
    )
    export.add_argument(
        "--out", required=True, help="output folder (diffusers, folder) or .safetensors file"
    )
    export.add_argument("--dtype", default="fp16", help="fp16 (default), bf16 or fp32")
    export.add_argument(
        "--merge", action="store_true", help="bake a LoRA run's adapters into the full model"
    )
    export.add_argument(
        "--merge-lora", metavar="FILE", help="add a kohya LoRA .safetensors to the full model"
    )
    export.add_argument("--lora-scale", type=float, default=1.0, help="its strength (default 1)")
    export.add_argument("--ema", action="store_true", help="export the EMA weights (ema.enabled)")
    export.add_argument(
        "--verbose", action="store_true", help="print the export's time and peak memory"
    )
    export.set_defaults(func=cmd_export)


def _add_runs(sub: Subcommands) -> None:
    """`impasto runs list|summary|plot`: read runs back."""
    runs = sub.add_parser("runs", help="read runs back: list, summary, plot").add_subparsers(
        dest="runs_command", required=True
    )
    listing = runs.add_parser("list", help="the runs under a folder, with status and step")
    listing.add_argument("dir", nargs="?", default="runs", help="default: runs")
    listing.set_defaults(func=cmd_runs_list)
    summary = runs.add_parser("summary", help="what a run did: steps, images, time, losses")
    summary.add_argument("run_dir")
    summary.set_defaults(func=cmd_runs_summary)
    plot = runs.add_parser("plot", help="loss, validation loss and lr of runs on shared axes")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    plot.add_argument("--out", required=True, help="the PNG to write")
    plot.set_defaults(func=cmd_runs_plot)


def _add_doctor(sub: Subcommands) -> None:
    """`impasto doctor`: the environment."""
    sub.add_parser("doctor", help="report the environment").set_defaults(func=cmd_doctor)


def _add_cache(sub: Subcommands) -> None:
    """`impasto cache CONFIG`: fill the disk cache."""
    cache = sub.add_parser(
        "cache",
        help="fill the disk cache of latents and text embeddings (split across torchrun ranks)",
    )
    cache.add_argument("config", help="YAML config file (cache.latents / text_embeddings: disk)")
    cache.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a value")
    cache.set_defaults(func=cmd_cache)


def _add_bench(sub: Subcommands) -> None:
    """`impasto bench`: the training step against the plain diffusers step, or packed against
    padded for a model that packs tokens."""
    bench = sub.add_parser(
        "bench",
        help="time the training step against the plain diffusers step, or packed against "
        "padded (FAMILY-PRESET models); synthetic data",
    )
    bench.add_argument(
        "--model",
        default="tiny",
        help="model preset: tiny, sdxl (default tiny), or FAMILY-PRESET of another family, "
        "e.g. the diffusion transformer's sizes (timed packed against padded), or one of a "
        "family's video models (FAMILY-video-tiny, FAMILY-7b-video: on clips)",
    )
    bench.add_argument(
        "--resolution", type=int, help="default: 64 for tiny, 1024 for sdxl; FAMILY-tiny 128, "
        "other FAMILY-PRESET 256",
    )  # fmt: skip
    bench.add_argument(
        "--batch", type=int, help="images per step (default 2; FAMILY-PRESET: dealt over 3 "
        "shapes, the square first, default as many as fill 3072 padded tokens; video models: "
        "clips, as many of each --frames)",
    )  # fmt: skip
    bench.add_argument(
        "--steps", type=int, help="timed steps per variant (default 10; FAMILY-PRESET 3)"
    )
    bench.add_argument("--warmup", type=int, help="untimed steps first (default 3; "
                       "FAMILY-PRESET 1)")  # fmt: skip
    bench.add_argument(
        "--rounds", type=int, help="repeat all variants, interleaved; median (default 1; "
        "FAMILY-PRESET 3)",
    )  # fmt: skip
    bench.add_argument("--estimate", action="store_true", help="FAMILY-PRESET: count FLOPs "
                       "per token, parameters and memory on the meta device; time nothing (any "
                       "size, on any machine)")  # fmt: skip
    bench.add_argument("--frames", type=int, nargs="+", metavar="N", help="video models: "
                       "one clip shape per frame count k·4+1 (1: an image)")  # fmt: skip
    bench.add_argument("--precision", default="auto", help="auto | bf16 | fp32 | pure_bf16")
    bench.add_argument("--device", default="auto")
    bench.add_argument(
        "--variants", nargs="+", default=["default"], help="named option sets (see docs)"
    )
    bench.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a value")
    bench.add_argument("--json", action="store_true", help="print the report as JSON")
    bench.add_argument("--json-file", metavar="PATH", help="also write the report as JSON to "
                       "PATH (the table still prints; its folder must exist)")  # fmt: skip
    bench.add_argument(
        "--parallel",
        default="none",
        metavar="{ddp,fsdp}",
        help="time the step on several processes (all visible GPUs; CPU: gloo) against one",
    )
    bench.add_argument(
        "--nproc", type=int, help="processes for --parallel (default: the GPU count, 2 on CPU)"
    )
    bench.set_defaults(func=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="impasto", description="Train SDXL-family models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        _add_train,
        _add_data,
        _add_sample,
        _add_train_vae,
        _add_inspect,
        _add_export,
        _add_runs,
        _add_doctor,
        _add_cache,
        _add_bench,
    ):
        add(sub)
    return parser


def _quiet_libraries() -> None:
    """Hide library notices a user cannot act on (issue #13); set before the libraries load."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # diffusers' deprecation notices name arguments of calls impasto makes, not the user.
    warnings.filterwarnings(
        "ignore", message=r".*is deprecated and will be removed in version", category=FutureWarning
    )
    for name in UNACTIONABLE_LOGGERS:
        logging.getLogger(name).addFilter(_is_actionable)  # the same filter is added only once


def _is_actionable(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not any(text in message for text in UNACTIONABLE_MESSAGES)


def _quiet_progress_bars() -> None:
    """No per-module "Loading weights" or checkpoint-shard bars while a command loads models.

    Called by the commands that load weights, which import these libraries anyway."""
    if _debug():
        return
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def _error_lines(error: Exception) -> list[str]:
    """A :class:`ConfigError` lists every problem, one per line; other errors show their first
    line (the rest, such as pydantic's per-field detail, is for ``IMPASTO_DEBUG=1``)."""
    from impasto.config.load import ConfigError

    lines = str(error).splitlines() or [type(error).__name__]
    return lines if isinstance(error, ConfigError) else lines[:1]


def main(argv: Sequence[str] | None = None) -> int:
    from impasto.train.signals import (
        EXIT_INTERRUPTED,
        StopRequest,
        forget_interrupts,
        raised_interrupt,
    )

    args = build_parser().parse_args(argv)
    forget_interrupts()
    if not _debug():
        _quiet_libraries()
    try:
        # SIGTERM / SIGINT stop a command at once with one line (the trainer, once it trains,
        # saves first: see impasto.train.signals).
        with StopRequest():
            return args.func(args)
    except Exception as error:
        interrupt = raised_interrupt()
        if interrupt is None:
            return _report(error)
        # The signal's Interrupted came out of library code as another error.
        print(f"impasto: {interrupt}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt as error:
        print(f"impasto: {error or 'interrupted'}", file=sys.stderr)
        return EXIT_INTERRUPTED


def _report(error: Exception) -> int:
    """One line (or one per config problem) for a user's mistake, and the exit code; an
    unexpected error is re-raised with its traceback."""
    if _debug() or not isinstance(error, (ValueError, OSError, FloatingPointError)):
        raise error
    if getattr(error, "rank_0_reports", False):  # every rank stops with it: rank 0 prints it
        return EXIT_USAGE
    if isinstance(error, (ValueError, FileNotFoundError)):
        for line in _error_lines(error):
            print(f"impasto: error: {line}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(error, OSError):  # no write permission (a run's full disk is a DiskFullError)
        where = f": {error.filename}" if error.filename else ""
        print(f"impasto: error: {error.strerror or error}{where}", file=sys.stderr)
        return 1
    print(f"impasto: error: {error}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
