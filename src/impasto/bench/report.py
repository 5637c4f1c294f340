"""The report of ``impasto bench`` as a table (the one-process form here; the parallel form is
:func:`impasto.bench.parallel.format_parallel_report`)."""

from __future__ import annotations

from typing import Any

from impasto.bench.step import show_value


def format_report(report: dict[str, Any]) -> str:
    """The report as a table."""
    if "strategy" in report:
        from impasto.bench.parallel import format_parallel_report

        return format_parallel_report(report)
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
