"""The report of ``impasto bench`` as a table: the one-process form, the packed-vs-padded form
of a model that packs tokens (:mod:`impasto.bench.packed`), and the parallel form
(:func:`impasto.bench.parallel.format_parallel_report`); where ``--json-file`` writes it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from impasto.bench.step import show_value


def check_report_file(path: str | None) -> Path | None:
    """``--json-file PATH`` checked before the bench runs: a report that took minutes of a GPU
    is not lost to a missing folder or a read-only one at the end."""
    if path is None:
        return None
    file = Path(path)
    if file.is_dir():
        raise ValueError(f"bench: --json-file {path} is a folder; name a file in it")
    if not file.parent.is_dir():
        raise ValueError(
            f"bench: --json-file {path}: the folder {file.parent} does not exist; create it first"
        )
    if not os.access(file.parent, os.W_OK) or (file.exists() and not os.access(file, os.W_OK)):
        raise ValueError(f"bench: --json-file {path} cannot be written; choose another path")
    return file


def format_report(report: dict[str, Any]) -> str:
    """The report as a table."""
    if "strategy" in report:
        from impasto.bench.parallel import format_parallel_report

        return format_parallel_report(report)
    if "image_tokens" in report:
        return format_packed_report(report)
    show = show_value

    lines = [
        f"impasto bench: {report['model']} at {report['resolution']}², batch {report['batch']}, "
        f"{report['precision']}, {report['device']}; {report['tflop_per_image']:.3g} TFLOP per "
        f"image (forward + backward); median of {report['rounds']} round(s) of "
        f"{report['steps']} steps",
        f"{'variant':<14} {'step ms':>9} {'img/s':>8} {'TFLOP/s':>8} {'MFU':>6} "
        f"{'peak GiB':>9} {'vs diffusers':>13}",
    ]
    for row in report["rows"]:
        if row.get("error"):
            lines.append(f"{row['name']:<14} {row['error']}")
            continue
        lines.append(
            f"{row['name']:<14} {row['step_ms']:>9.1f} {row['images_per_s']:>8.2f} "
            f"{show(row['tflops'], '.1f'):>8} {show(row['mfu'], '.1%'):>6} "
            f"{show(row['peak_memory_gib'], '.2f'):>9} {row['vs_diffusers']:>13.3f}"
        )
    return "\n".join(lines)


def format_packed_report(report: dict[str, Any]) -> str:
    """The packed-vs-padded report: the samples, FLOPs and memory, then (unless it is an
    estimate) a row per variant and layout and the ratio of each variant."""
    show, memory = show_value, report["memory_gib"]
    clips = report.get("clips", False)
    noun, tokens = ("samples", "sample tokens") if clips else ("images", "image tokens")
    sequence = report["sequence_tokens"]
    extra = report["padded_flops_per_step"] / report["packed_flops_per_step"] - 1
    variant = report.get("memory_variant", "default")
    lines = [
        f"impasto bench{' --estimate' if report['estimate'] else ''}: {report['model']} at "
        f"{report['resolution']}², {report['precision']}, {report['device']}; "
        f"{report['images']} {noun if report['images'] != 1 else noun[:-1]} "
        f"({describe_shapes(report['shapes'], clips)}): "
        f"{report['image_tokens']} {tokens}",
        f"parameters: {count(report['trained_parameters'])} trained, "
        f"{count(report['frozen_parameters'])} frozen; "
        f"{count(report['flops_per_token'], 'FLOP')} per {tokens[:-1]}, "
        f"{count(report['flops_per_step'], 'FLOP')} per step ({report['flops_method']})",
        f"memory before activations{'' if variant == 'default' else f' ({variant})'}: "
        f"weights {memory['weights']:.2f} + gradients {memory['gradients']:.2f} + optimizer "
        f"{memory['optimizer']:.2f} + EMA {memory['ema']:.2f} = "
        f"{memory['trained_total']:.2f} GiB trained; frozen networks {memory['frozen']:.2f} GiB"
        f"{frozen_parts(report)}",
        *released_parts(report),
    ]
    if "padded" in report.get("layouts", ("padded", "packed")):
        lines.append(
            f"packed: the {noun} end to end in {sequence['packed']} tokens; padded (baseline): "
            f"each padded to the largest one's tokens, {sequence['padded']} tokens "
            f"({extra:+.1%} FLOPs)"
        )
    else:
        lines.append(
            f"packed: {sequence['packed']} tokens; one shape, nothing to pad: the padded "
            "layout is the same sequence and is not timed"
        )
    if report["estimate"]:
        return "\n".join([*lines, "estimate only: nothing was timed"])
    lines += [
        f"median of {report['rounds']} interleaved round(s) of {report['steps']} steps",
        f"{'variant':<14} {'layout':<7} {'sequence':>8} {'fill':>7} {'step ms':>9} "
        f"{'tokens/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9} {'vs padded':>10}",
    ]
    for row in report["rows"]:
        head = f"{row['variant']:<14} {row['layout']:<7} {row['sequence_tokens']:>8} "
        head += f"{row['fill']:>7.1%}"
        if row.get("error"):
            lines.append(f"{head} {row['error']}")
            continue
        lines.append(
            f"{head} {row['step_ms']:>9.1f} {row['tokens_per_s']:>9.0f} "
            f"{show(row['tflops'], '.3g'):>8} {show(row['mfu'], '.1%'):>6} "
            f"{show(row['peak_memory_gib'], '.2f'):>9} {show(row['vs_padded'], '.3f'):>10}"
        )
    for ratio in report["ratios"]:
        lines.append(
            f"{ratio['variant']}: padded / packed step time {ratio['median']:.3f} (median of "
            f"{len(ratio['rounds'])} rounds, {ratio['min']:.3f}-{ratio['max']:.3f})"
        )
    return "\n".join(lines)


def frozen_parts(report: dict[str, Any]) -> str:
    """`` (transformer 11.08 in float8, text_encoder_2 8.80, ...)``: the frozen weights by
    network, largest first, and the dtype of the base under adapters (``memory.frozen_dtype``);
    empty for a report without them."""
    sizes = report.get("frozen_gib")
    if not sizes:
        return ""
    parts = [f"{name} {gib:.2f}" for name, gib in sorted(sizes.items(), key=lambda kv: -kv[1])]
    return f" ({', '.join(parts)}; memory.frozen_dtype {report.get('frozen_dtype', 'fp32')})"


def released_parts(report: dict[str, Any]) -> list[str]:
    """The line of the text encoders a run with cached text releases (not in the frozen
    networks' total), largest first; none for a report without them."""
    sizes = report.get("released_gib")
    if not sizes:
        return []
    parts = [f"{name} {gib:.2f}" for name, gib in sorted(sizes.items(), key=lambda kv: -kv[1])]
    return [
        f"text encoders released once their embeddings are cached (cache.text_embeddings), "
        f"not counted above: {' + '.join(parts)} GiB"
    ]


def describe_shapes(shapes: list[dict[str, Any]], clips: bool) -> str:
    """``4 × 256x256 of 256 tokens, ...``; clips: ``9 × 17 frames of 64x64, 80 tokens``."""
    if not clips:
        return ", ".join(
            f"{s['images']} × {s['height']}x{s['width']} of {s['tokens']} tokens" for s in shapes
        )
    return ", ".join(
        f"{s['images']} × {s['frames']} frame{'s' if s['frames'] > 1 else ''} of "
        f"{s['height']}x{s['width']}, {s['tokens']} tokens"
        for s in shapes
    )


def count(value: float, unit: str = "") -> str:
    """``value`` with an SI prefix: 2.6 M, 941 M, 7.61 B (FLOP: 11.7 MFLOP, 79.4 TFLOP)."""
    prefixes = ("T", "G", "M", "k") if unit else ("B", "M", "k")
    for scale, prefix in zip((1e12, 1e9, 1e6, 1e3)[-len(prefixes) :], prefixes, strict=True):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()
