"""Peak memory and time of ``impasto export`` on SDXL-sized runs (issue #17).

    python benchmarks/export_memory.py --workdir DIR [--size sdxl|tiny] [--base diffusers]
        [--whole]

Writes, without training anything (a full-size SDXL does not train on a CPU), into DIR:

- the base model, the ``model.path`` of the runs below as a user's download would be: an
  SDXL-shaped single file ``base.safetensors`` (fp16 zeros; 6.9 GB for ``sdxl``) or, with
  ``--base diffusers``, a diffusers folder ``base-diffusers/`` (fp16 zeros);
- run ``full``: ``parts.unet: full``; its checkpoint's ``unet.safetensors`` is the whole fp32
  UNet (10.3 GB for SDXL);
- run ``lora``: LoRA rank 16 on the UNet and both text encoders (attention and feed-forward);
- with ``--whole``, run ``preset``: like ``full`` but from ``model.preset``, which only the
  whole-model path can rebuild (a randomly initialised fp32 SDXL: minutes and about 16 GB).

Every tensor is written one at a time from a zero of its shape, so writing takes little memory.
Then each export runs alone in a fresh Python process, which reports its peak resident memory
(``ru_maxrss``) and wall time; the first line is a process that only imports impasto.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import torch

from impasto.config import build_config, config_to_yaml
from impasto.models.io import save_diffusers
from impasto.models.parts import prepare_parts
from impasto.models.presets import build_preset, build_tiny
from impasto.models.sdxl import SDXLBackbone
from impasto.models.single_file import configs_of, sgm_state_dict, write_safetensors
from impasto.models.single_file.configs import CONFIGS_METADATA_KEY

STEP = 100
RUNS = {
    "full": {"parts": {"unet": "full"}},
    "lora": {
        "parts": {"unet": "lora", "text_encoder": "lora", "text_encoder_2": "lora"},
        "lora": {"rank": 16, "targets": "attention_ff"},
    },
    "preset": {"parts": {"unet": "full"}},
}
EXPORTS = [  # (format, run, extra option)
    ("single-file", "full", ""),
    ("diffusers", "full", ""),
    ("single-file", "lora", "merge"),
    ("lora-kohya", "lora", ""),
    ("lora-diffusers", "lora", ""),
]
MEASURE = textwrap.dedent(
    """
    import json, resource, sys, time
    started = time.perf_counter()
    if len(sys.argv) > 1:
        from impasto.export import ExportOptions, export_checkpoint
        options = ExportOptions("fp16", merge=sys.argv[4] == "merge")
        export_checkpoint(sys.argv[1], sys.argv[2], sys.argv[3], options)
    else:
        import impasto.export  # the baseline: the libraries alone
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": time.perf_counter() - started, "peak_gib": peak_kib / 2**20}))
    """
)


def _zeros(like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zero tensor of ``like``'s shape that takes no memory until the writer copies it."""
    return torch.zeros((), dtype=dtype).expand(like.shape)


def _skeleton(size: str):
    """The preset's networks on the meta device: names and shapes, nothing allocated."""
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore", UserWarning)  # tiny's shipped VAE copied into meta
        return build_preset(size, 0)


def write_base(root: Path, size: str, kind: str) -> Path:
    skeleton = _skeleton(size)
    if kind == "single-file":
        path = root / "base.safetensors"
        state = {key: _zeros(t, t.dtype) for key, t in sgm_state_dict(skeleton).items()}
        metadata = {CONFIGS_METADATA_KEY: configs_of(skeleton).to_json()}  # as save_single_file
        write_safetensors(path, state, dtype=torch.float16, metadata=metadata)
        return path
    folder = root / "base-diffusers"
    save_diffusers(build_tiny(0), folder)  # the layout: model_index, scheduler, tokenizers
    for name, weights in (
        ("unet", "diffusion_pytorch_model.safetensors"),
        ("vae", "diffusion_pytorch_model.safetensors"),
        ("text_encoder", "model.safetensors"),
        ("text_encoder_2", "model.safetensors"),
    ):
        module = getattr(skeleton, name)
        if name.startswith("text_encoder"):
            module.config.save_pretrained(folder / name)
        else:
            module.save_config(folder / name)
        state = {key: _zeros(t, t.dtype) for key, t in module.state_dict().items()}
        write_safetensors(folder / name / weights, state, dtype=torch.float16)
    return folder


def write_run(root: Path, name: str, size: str, base: Path) -> Path:
    """A run directory whose newest checkpoint has the shapes a real ``name`` run would save."""
    model = {"preset": size} if name == "preset" else {"path": str(base)}
    raw = {
        "config_version": 1,
        "model": model,
        "data": {"path": str(root / "no-data"), "resolution": 1024, "batch_size": 1},
        "train": {"output_dir": str(root / name), "max_steps": STEP},
        **RUNS[name],
    }
    config = build_config(raw)
    parts = prepare_parts(config, SDXLBackbone(_skeleton(size)))
    checkpoint = root / name / "checkpoints" / f"step-{STEP:08d}"
    checkpoint.mkdir(parents=True, exist_ok=True)
    for part_name, part in parts.items():
        state = {key: _zeros(tensor) for key, tensor in part.state_dict().items()}
        write_safetensors(checkpoint / f"{part_name}.safetensors", state)
    (checkpoint / "config.yaml").write_text(config_to_yaml(config), encoding="utf-8")
    state = {"train": {"step": STEP, "samples_seen": STEP}, "data": {"epoch": 0}}
    (checkpoint / "state.json").write_text(json.dumps(state), encoding="utf-8")
    return root / name


def measure(args: list[str]) -> dict[str, float]:
    """Run one export (or, with no args, the import alone) in a fresh process."""
    done = subprocess.run([sys.executable, "-c", MEASURE, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"export {args} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--size", default="sdxl", choices=["sdxl", "tiny"])
    parser.add_argument("--base", default="single-file", choices=["single-file", "diffusers"])
    parser.add_argument("--whole", action="store_true", help="also the whole-model path")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    base = write_base(args.workdir, args.size, args.base)
    exports = EXPORTS + ([("single-file", "preset", "")] if args.whole else [])
    runs = {run: write_run(args.workdir, run, args.size, base) for _, run, _ in exports}
    baseline = measure([])
    print(f"import impasto.export alone: peak {baseline['peak_gib']:.2f} GiB")
    for fmt, run, extra in exports:
        out = args.workdir / "out" / (fmt + (".safetensors" if fmt != "diffusers" else ""))
        if fmt == "lora-diffusers":
            out = out.with_suffix("")
        result = measure([str(runs[run]), fmt, str(out), extra])
        label = f"{fmt}{' --merge' if extra else ''} ({run} run)"
        print(f"{label:32s} {result['seconds']:7.1f} s, peak {result['peak_gib']:.2f} GiB")
        shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
