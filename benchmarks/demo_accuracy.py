"""Train the demo config (with overrides) and measure how well its samples follow the prompt.

    python benchmarks/demo_accuracy.py OUT_DIR [--images-per-prompt N] [key=value ...]

Trains ``configs/demo.yaml`` with the given ``--set``-style overrides into ``OUT_DIR/run``,
generates ``N`` images for each of the 18 (colour, shape) prompts (backgrounds varying, seeds
1000…) with the config's sampling settings, scores them with :mod:`impasto.demo_score`, and
prints one JSON line: overrides, training seconds, colour and shape accuracy, the colour
confusions. The demo acceptance test (tests/test_demo.py) runs the same measurement.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from impasto.config import load_config
from impasto.demo_score import score_demo_checkpoint
from impasto.train.trainer import train

DEMO_CONFIG = Path(__file__).parents[1] / "configs" / "demo.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--images-per-prompt", type=int, default=4)
    parser.add_argument("--data", type=Path, help="demo dataset folder (default OUT/data)")
    parser.add_argument("--device", default="cpu", help="where to sample (training: train.device)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    data = args.data or args.out / "data"
    config = load_config(
        DEMO_CONFIG,
        [
            f"train.output_dir={args.out / 'run'}",
            f"data.path={data}",
            "log.progress_bar=false",
            *args.overrides,
        ],
    )
    start = time.perf_counter()
    result = train(config)
    seconds = time.perf_counter() - start
    score = score_demo_checkpoint(result.run_dir, args.images_per_prompt, args.device)
    print(
        json.dumps({"overrides": args.overrides, "train_s": round(seconds, 1), **score.as_dict()}),
        flush=True,
    )


if __name__ == "__main__":
    main()
