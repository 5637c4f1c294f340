"""Merge the stage results of ``run.sh`` (``WORK/*.json``) into ``OUT/results.json`` and a
Markdown table ``OUT/results.md``: what goes into benchmarks/RESULTS.md.

    python benchmarks/gpu/report.py WORK --out OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

STAGE_FILES = (
    "env", "ceilings", "tests", "sdxl-512", "sdxl-1024", "sdxl-1024-compile", "sdxl-1024-memory",
    "fsdp", "draftp", "cache", "train-cached", "dit-tiny", "dit-xl", "dit-video", "flux-lora",
)  # fmt: skip

# The seed's table (seeds/002, NeMo's diffusion framework): its DiT 7B with cross-attention,
# benchmarked on 32 H100 DGX nodes (8k tokens: 256 frames of 256px video as latents).
SEED_7B = (
    ("baseline, no optimization", "8k", None, None),
    ("TP=2 SP", "8k", 519, 10052),
    ("TP=2 SP CP=4", "74k", 439, 3409),
)
H100_PEAK_TFLOPS = 989.4  # dense bf16, SXM (impasto.logging.flops)


def read_results(work: Path) -> dict[str, Any]:
    """Each stage's JSON (absent ones left out) and each stage's exit status and time."""
    results: dict[str, Any] = {"stages": {}}
    for name in STAGE_FILES:
        status = work / f"{name}.status.json"
        if status.is_file():
            results["stages"][name] = json.loads(status.read_text())
        data = work / f"{name}.json"
        if data.is_file():
            try:
                results[name] = json.loads(data.read_text())
            except json.JSONDecodeError as error:
                results[name] = {"error": f"unreadable {data.name}: {error}"}
    return results


def number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def bench_table(report: dict[str, Any]) -> list[str]:
    """One ``impasto bench`` report as Markdown rows (the one-process or the parallel form)."""
    if "strategy" in report:
        lines = ["| variant | strategy | step ms | img/s | speed-up |", "|---|---|---|---|---|"]
        for row in report["rows"]:
            lines.append(f"| {row['name']} | none x1 | {row['baseline_step_ms']:.1f} | - | 1.000 |")
            lines.append(
                f"| {row['name']} | {report['strategy']} x{report['world']} | "
                f"{row['step_ms']:.1f} | {row['samples_per_s']:.2f} | {row['speedup']:.3f} |"
            )
        return lines
    lines = [
        f"{report['model']} at {report['resolution']}², batch {report['batch']}, "
        f"{report['precision']}, {report['device']}; {report['tflop_per_image']:.3g} TFLOP per "
        f"image; median of {report['rounds']} interleaved rounds of {report['steps']} steps",
        "",
        "| variant | step ms | rounds (ms) | img/s | TFLOP/s | MFU | peak GiB | vs diffusers |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        if row.get("error"):
            lines.append(f"| {row['name']} | {row['error']} | | | | | | |")
            continue
        spread = ", ".join(f"{value:.1f}" for value in row.get("rounds_ms") or [])
        lines.append(
            f"| {row['name']} | {row['step_ms']:.1f} | {spread} | {row['images_per_s']:.2f} | "
            f"{number(row['tflops'], '.1f')} | {number(row['mfu'], '.1%')} | "
            f"{number(row['peak_memory_gib'], '.2f')} | {row['vs_diffusers']:.3f} |"
        )
    return lines


def packed_table(report: dict[str, Any]) -> list[str]:
    """An ``impasto bench --model dit-*`` report (packed against padded) as Markdown rows."""
    noun = "samples" if report.get("clips") else "images"
    shapes = ""
    if report.get("clips"):
        shapes = " (" + ", ".join(
            f"{s['images']} × {s['frames']} frames of {s['height']}x{s['width']}"
            for s in report["shapes"]
        ) + ")"  # fmt: skip
    lines = [
        f"{report['model']} at {report['resolution']}², {report['precision']}, "
        f"{report['device']}; {report['images']} {noun if report['images'] != 1 else noun[:-1]}"
        f"{shapes}, {report['image_tokens']} "
        f"{noun[:-1]} tokens; {report['flops_per_token'] / 1e9:.3g} GFLOP per {noun[:-1]} "
        "token (meta count); "
        f"{report['trained_parameters'] / 1e6:.0f} M parameters; median of {report['rounds']} "
        f"interleaved rounds of {report['steps']} steps",
        "",
        "| variant | layout | sequence | fill | step ms | rounds (ms) | tokens/s | TFLOP/s | MFU "
        "| peak GiB | vs padded |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        head = (
            f"| {row['variant']} | {row['layout']} | {row['sequence_tokens']} | {row['fill']:.1%}"
        )
        if row.get("error"):
            lines.append(f"{head} | {row['error']} | | | | | | |")
            continue
        spread = ", ".join(f"{value:.1f}" for value in row.get("rounds_ms") or [])
        lines.append(
            f"{head} | {row['step_ms']:.1f} | {spread} | {row['tokens_per_s']:.0f} | "
            f"{number(row['tflops'], '.1f')} | {number(row['mfu'], '.1%')} | "
            f"{number(row['peak_memory_gib'], '.2f')} | {number(row['vs_padded'], '.3f')} |"
        )
    for ratio in report["ratios"]:
        lines += [
            "",
            f"{ratio['variant']}: padded / packed step time {ratio['median']:.3f} "
            f"(median of {len(ratio['rounds'])} rounds, {ratio['min']:.3f}-{ratio['max']:.3f})",
        ]
    return lines


def seed_table(report: dict[str, Any]) -> list[str]:
    """The video DiT's rows per device next to the seed's table for its 7B DiT (#32)."""
    lines = [
        "",
        "Per device, next to the seed's table (NeMo's DiT 7B, 32 H100 DGX nodes; MFU of its "
        f"TFLOP/s against {H100_PEAK_TFLOPS} dense bf16):",
        "",
        "| run | context | config | tokens/s per GPU | TFLOP/s per GPU | MFU |",
        "|---|---|---|---|---|---|",
    ]
    context = f"{report['sequence_tokens']['packed']}"
    for row in report["rows"]:
        if row.get("error"):
            lines.append(f"| {report['model']}, 1 GPU | {context} | {row['variant']} | "
                         f"{row['error']} | | |")  # fmt: skip
            continue
        lines.append(
            f"| {report['model']}, 1 GPU | {context} | {row['variant']}, {row['layout']} | "
            f"{row['tokens_per_s']:.0f} | {number(row['tflops'], '.1f')} | "
            f"{number(row['mfu'], '.1%')} |"
        )
    for config, tokens, tflops, rate in SEED_7B:
        mfu = None if tflops is None else tflops / H100_PEAK_TFLOPS
        lines.append(
            f"| seed: NeMo DiT 7B | {tokens} | {config} | {number(rate, '.0f')} | "
            f"{'OOM' if tflops is None else tflops} | {number(mfu, '.1%')} |"
        )
    return lines


def markdown(results: dict[str, Any]) -> str:
    lines = ["# GPU campaign results", ""]
    lines += ["| stage | exit | seconds |", "|---|---|---|"]
    for name, status in results["stages"].items():
        lines.append(f"| {name} | {status['exit']} | {status['seconds']} |")
    if "ceilings" in results:
        ceilings = results["ceilings"]
        lines += [
            "",
            f"Ceilings on {ceilings['device']} (torch {ceilings['torch']}): bf16 "
            f"{ceilings['bf16_matmul']['size']}³ matmul {ceilings['bf16_matmul']['tflops']:.1f} "
            f"TFLOP/s, fp32 {ceilings['fp32_matmul_tf32_off']['tflops']:.1f} TFLOP/s, copy "
            f"{ceilings['copy']['gbps']:.0f} GB/s (read + write).",
        ]
    if "tests" in results:
        lines += ["", f"CUDA tests: {results['tests'].get('summary', '?')}"]
    for name in ("sdxl-512", "sdxl-1024", "sdxl-1024-compile", "sdxl-1024-memory", "fsdp"):
        if name in results and "rows" in results[name]:
            lines += ["", f"## {name}", "", *bench_table(results[name])]
    for name in ("dit-tiny", "dit-xl", "dit-video", "flux-lora"):
        if name in results and "rows" in results[name]:
            lines += ["", f"## {name}", "", *packed_table(results[name])]
    if "dit-video" in results and "rows" in results["dit-video"]:
        lines += seed_table(results["dit-video"])
    if "draftp" in results and "steps" in results["draftp"]:
        draftp = results["draftp"]
        lines += [
            "",
            f"## draftp at {draftp['resolution']}², {draftp['sampler_steps']} sampler "
            "steps, LoRA 32, K=1",
            "",
            "| step | s | peak GiB |",
            "|---|---|---|",
        ]
        for step in draftp["steps"]:
            memory = step.get("peak_memory_gib", step.get("peak_rss_gib"))
            lines.append(f"| {step['step']} | {step['step_time']:.2f} | {number(memory, '.2f')} |")
    if "cache" in results:
        cache = results["cache"]
        lines += [
            "",
            f"Cache fill at {cache['resolution']}²: {cache['images']} images, "
            f"{number(cache.get('images_per_s'), '.1f')} img/s.",
        ]
    if "train-cached" in results:
        run = results["train-cached"]
        lines += [
            "",
            f"configs/sdxl-lora.yaml on the cache at {run['resolution']}², median of steps "
            f"{run['steps'] - run['measured_steps'] + 1}-{run['steps']}: "
            f"{number(run['step_time'], '.3f')} s/step, "
            f"{number(run['samples_per_s'], '.2f')} img/s, MFU {number(run['mfu'], '.1%')}, "
            f"data wait {number(run['data_wait'], '.1%')}, peak "
            f"{number(run['peak_memory_gib'], '.2f')} GiB.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = read_results(args.work)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    text = markdown(results)
    (args.out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
