"""``impasto bench --model dit-*``: the DiT's training step packed against padded, its FLOPs
per token against an analytic count, and the meta-device estimate of the large sizes (speed
itself is measured in benchmarks/RESULTS.md, never asserted in tests)."""

from __future__ import annotations

import statistics

import pytest

from impasto.bench import format_report, run_bench
from impasto.cli import main

TEXT_TOKENS = 77  # CLIP's sequence
FREQUENCIES = 256  # sinusoidal features of the time
PATCH_VALUES = 4 * 2 * 2  # 4 latent channels × a 2x2 patch


def linear(rows: int, fan_in: int, fan_out: int, input_grad: bool = True) -> int:
    """A linear layer's matmul FLOPs: forward, weight gradient, and the input's gradient when
    the input needs one (cached latents, text and the time features do not)."""
    return 2 * rows * fan_in * fan_out * (3 if input_grad else 2)


def cross_block_step_flops(
    width: int, layers: int, text_dim: int, pooled_dim: int, groups: list[tuple[int, int]],
    sequence: int,
) -> int:  # fmt: skip
    """Forward + backward FLOPs of the ``cross`` DiT on a pack of ``sequence`` tokens holding
    ``groups`` (images, tokens each); attention within each image, at its math cost
    (QKᵀ and AV: 4·Sq·Sk·D forward, twice that backward)."""
    images = sum(count for count, _ in groups)
    text = images * TEXT_TOKENS
    flops = linear(sequence, PATCH_VALUES, width, input_grad=False)
    flops += linear(images, FREQUENCIES, width, input_grad=False) + linear(images, width, width)
    flops += linear(images, pooled_dim, width, input_grad=False) + linear(images, width, width)
    flops += linear(text, text_dim, width, input_grad=False) + linear(text, width, width)
    block = linear(images + 1, width, 9 * width)  # the modulation; + the padding's zero row
    block += 6 * linear(sequence, width, width)  # q, k, v, out; the cross-attention's q, out
    block += 2 * linear(text, width, width)  # the cross-attention's k, v of the text tokens
    block += linear(sequence, width, 4 * width) + linear(sequence, 4 * width, width)
    block += sum(3 * 4 * count * tokens * tokens * width for count, tokens in groups)
    block += sum(3 * 4 * count * tokens * TEXT_TOKENS * width for count, tokens in groups)
    flops += layers * block
    return flops + linear(images + 1, width, 2 * width) + linear(sequence, width, PATCH_VALUES)


def cross_block_parameters(width: int, layers: int, heads: int, text_dim: int, pooled: int) -> int:
    """Parameters of the ``cross`` DiT with patch 2 over 4 latent channels."""
    attention = 4 * (width * width + width) + 2 * (width // heads)  # + the q, k RMSNorm weights
    mlp = (4 * width * width + 4 * width) + (4 * width * width + width)
    block = 2 * attention + mlp + 9 * width * width + 9 * width
    embedders = (PATCH_VALUES + 1) * width
    for fan_in in (FREQUENCIES, pooled, text_dim):
        embedders += (fan_in + 1) * width + (width + 1) * width
    final = (2 * width * width + 2 * width) + (width * PATCH_VALUES + PATCH_VALUES)
    return layers * block + embedders + final


def test_the_tiny_bench_times_packed_against_padded_with_counted_flops_per_token():
    report = run_bench("dit-tiny", steps=1, warmup=0, rounds=2, device="cpu")
    # The demo's three aspect ratios at 256², 4 images each: 256, 240 and 240 tokens.
    assert [(s["height"], s["width"], s["images"], s["tokens"]) for s in report["shapes"]] == [
        (256, 256, 4, 256), (192, 320, 4, 240), (320, 192, 4, 240)
    ]  # fmt: skip
    assert report["image_tokens"] == 2944
    assert report["sequence_tokens"] == {"padded": 12 * 256, "packed": 2944}
    groups = [(4, 256), (4, 240), (4, 240)]
    tiny = (128, 6, 64, 32)  # width, layers, text features (32 + 32), pooled text
    assert report["flops_per_step"] == cross_block_step_flops(*tiny, groups, 2944)
    assert report["packed_flops_per_step"] == report["flops_per_step"]  # a full pack
    assert report["padded_flops_per_step"] == cross_block_step_flops(*tiny, groups, 3072)
    assert report["flops_per_token"] == pytest.approx(report["flops_per_step"] / 2944)
    assert report["trained_parameters"] == cross_block_parameters(128, 6, 4, 64, 32)
    memory = report["memory_gib"]  # fp32 weights and gradients, AdamW's two moments
    assert memory["weights"] * 2**30 == 4 * report["trained_parameters"]
    assert memory["gradients"] == memory["weights"]
    assert memory["optimizer"] == pytest.approx(2 * memory["weights"], rel=1e-4)  # + steps
    rows = {(row["variant"], row["layout"]): row for row in report["rows"]}
    assert list(rows) == [("default", "padded"), ("default", "packed")]
    padded, packed = rows["default", "padded"], rows["default", "packed"]
    assert (padded["fill"], packed["fill"]) == (pytest.approx(2944 / 3072), 1.0)
    for row in (padded, packed):
        assert row["step_ms"] > 0 and len(row["rounds_ms"]) == 2
        assert row["tokens_per_s"] == pytest.approx(2944e3 / row["step_ms"])
        assert row["tflops"] == pytest.approx(report["flops_per_step"] / row["step_ms"] / 1e9)
        assert row["mfu"] is None and row["peak_memory_gib"] is None  # a CPU: no peak known
    (ratio,) = report["ratios"]
    each = [a / b for a, b in zip(padded["rounds_ms"], packed["rounds_ms"], strict=True)]
    assert ratio["rounds"] == pytest.approx(each)
    assert ratio["median"] == pytest.approx(statistics.median(each)) == packed["vs_padded"]
    assert ratio["min"] <= ratio["median"] <= ratio["max"]
    text = format_report(report)
    assert "3072   95.8%" in text and "2944  100.0%" in text
    assert f"default: padded / packed step time {ratio['median']:.3f} (median of 2 rounds" in text


def test_the_images_flops_leave_out_the_padding_of_a_pack_they_do_not_fill():
    """3 images of 16, 15 and 15 tokens (64²) in packs of 128: the images' FLOPs are those of a
    sequence of exactly their 46 tokens, each layout's those of its 128."""
    report = run_bench("dit-tiny", resolution=64, batch=3, estimate=True, device="cpu")
    assert report["sequence_tokens"] == {"padded": 128, "packed": 128}
    groups, tiny = [(1, 16), (1, 15), (1, 15)], (128, 6, 64, 32)
    assert report["flops_per_step"] == cross_block_step_flops(*tiny, groups, 46)
    assert report["packed_flops_per_step"] == cross_block_step_flops(*tiny, groups, 128)
    assert report["padded_flops_per_step"] == report["packed_flops_per_step"]


def test_the_7b_estimate_counts_parameters_flops_and_memory_on_the_meta_device():
    report = run_bench("dit-7b", estimate=True, device="cpu")
    # NeMo's DiT7BConfig shape (32 layers, width 3072, 24 heads) with SDXL's text widths:
    # 7.61 B, +8.7 % on the nominal 7 B: its cross-attention keys read D-wide text tokens (after
    # PixArt's caption projection), NeMo's read 1024-wide ones.
    parameters = cross_block_parameters(3072, 32, 24, 2048, 1280)
    assert report["trained_parameters"] == parameters == 7_610_248_208
    groups = [(4, 256), (4, 240), (4, 240)]
    assert report["flops_per_step"] == cross_block_step_flops(3072, 32, 2048, 1280, groups, 2944)
    memory = report["memory_gib"]
    # fp32 weights and gradients, AdamW's two moments (and a step count per tensor)
    assert memory["trained_total"] * 2**30 == pytest.approx(16 * parameters, rel=1e-6)
    assert report["rows"] == [] and report["ratios"] == []
    text = format_report(report)
    assert "7.61 B trained" in text and "estimate only: nothing was timed" in text
    assert "meta device" in text


def test_cli_refuses_a_large_model_on_the_cpu_and_names_the_valid_models(capsys):
    assert main(["bench", "--model", "dit-xl", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dit-xl trains 941 M parameters, too many to time" in err
    assert "add --estimate" in err
    assert main(["bench", "--model", "dit-huge"]) == 2
    err = capsys.readouterr().err
    assert "unknown --model 'dit-huge'; valid: tiny, demo, sdxl, dit-tiny, dit-s" in err
    assert main(["bench", "--model", "tiny", "--estimate"]) == 2
    assert "--estimate is for FAMILY-PRESET models, not tiny" in capsys.readouterr().err
    assert main(["bench", "--model", "dit-tiny", "--batch", "0"]) == 2
    assert "--batch 0: give at least one image" in capsys.readouterr().err


def test_the_batch_is_dealt_over_the_shapes_square_first():
    from impasto.bench.mix import image_mix

    class Probe:  # a patch-2 DiT on a factor-8 VAE: a token per 16x16 pixels
        def sequence_length(self, height: int, width: int) -> int:
            return (height // 16) * (width // 16)

    four = image_mix(Probe(), 256, 4)
    assert four.shapes == ((256, 256), (192, 320), (320, 192)) and four.counts == (2, 1, 1)
    assert four.tokens == (256, 240, 240)
    one = image_mix(Probe(), 1024, 1)  # a FLUX LoRA step at 1024², batch 1
    assert one.shapes == ((1024, 1024),) and one.counts == (1,) and one.tokens == (4096,)
    assert one.layouts() == ("packed",)
    assert image_mix(Probe(), 256, None).counts == (4, 4, 4)  # 3072 padded tokens


def test_reused_builds_are_equal_independent_copies_and_the_registry_is_restored():
    import torch

    from impasto.bench.step import bench_config
    from impasto.models.backbone import BACKBONES, build_backbone, reusing_builds

    config = bench_config("tiny", 64, 1, "auto", "cpu", ["model.family=dit"])
    builders = dict(BACKBONES)
    with reusing_builds():
        first, second = (build_backbone(config).denoiser() for _ in range(2))
    assert BACKBONES == builders
    fresh = build_backbone(config).denoiser().state_dict()
    for name, value in first.state_dict().items():
        other = second.state_dict()[name]
        assert torch.equal(value, fresh[name]) and torch.equal(other, fresh[name])
        assert value.data_ptr() != other.data_ptr()


def test_cli_bench_help_and_parallel_refusal(capsys):
    assert main(["bench", "--model", "dit-tiny", "--parallel", "ddp"]) == 2
    assert "--parallel is not built for dit-tiny yet" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "--estimate" in capsys.readouterr().out
