"""``impasto bench --model dit-video-tiny | dit-7b-video`` (issue #32): the video DiT's step on
clips, its FLOPs against an analytic count with the frame axis (full attention over each clip;
spatio-temporal attention: within each frame, then across the frames), the 8k-token 7B
estimate, and the CLI's checks. Speed is measured in benchmarks/RESULTS.md, never asserted."""

from __future__ import annotations

import pytest
import torch

from impasto.bench import format_report, run_bench
from impasto.cli import main

TEXT_TOKENS = 77  # CLIP's sequence
FREQUENCIES = 256  # sinusoidal features of the time
VIDEO_PATCH_VALUES = 8 * 2 * 2  # the demo video VAE's 8 latent channels × a 2x2 patch
TINY = (128, 6, 64, 32)  # width, layers, text features (32 + 32), pooled text
SEVEN_B = (3072, 32, 2048, 1280)  # NeMo's DiT7BConfig width and depth, SDXL's text widths


def linear(rows: int, fan_in: int, fan_out: int, input_grad: bool = True) -> int:
    """A linear layer's matmul FLOPs: forward, weight gradient, and the input's gradient when
    the input needs one (cached latents, text and the time features do not)."""
    return 2 * rows * fan_in * fan_out * (3 if input_grad else 2)


def attention(queries: int, keys: int, width: int) -> int:
    """QKᵀ and AV over all heads at their math cost: 4·Sq·Sk·D forward, twice that backward."""
    return 3 * 4 * queries * keys * width


def video_step_flops(
    width: int, layers: int, text_dim: int, pooled_dim: int, clips: list[tuple[int, int, int]],
    sequence: int, layout: str = "full",
) -> int:  # fmt: skip
    """Forward + backward FLOPs of the ``cross`` DiT on a pack of ``sequence`` tokens holding
    ``clips`` (count, latent frames, tokens per frame); ``layout`` full (each clip attends
    to itself) or spatiotemporal (each frame to itself, then each patch position across the
    frames through ``attn_temporal``, with 3 modulation vectors more)."""
    samples = sum(count for count, _, _ in clips)
    text = samples * TEXT_TOKENS
    temporal = layout == "spatiotemporal"
    flops = linear(sequence, VIDEO_PATCH_VALUES, width, input_grad=False)
    flops += linear(samples, FREQUENCIES, width, input_grad=False) + linear(samples, width, width)
    flops += linear(samples, pooled_dim, width, input_grad=False) + linear(samples, width, width)
    flops += linear(text, text_dim, width, input_grad=False) + linear(text, width, width)
    modulations = 12 if temporal else 9
    block = linear(samples + 1, width, modulations * width)  # + the padding's zero row
    block += (10 if temporal else 6) * linear(sequence, width, width)  # q, k, v, out ×2 or 3
    block += 2 * linear(text, width, width)  # the cross-attention's k, v of the text tokens
    block += linear(sequence, width, 4 * width) + linear(sequence, 4 * width, width)
    for count, frames, per_frame in clips:
        tokens = frames * per_frame
        if temporal:
            block += count * frames * attention(per_frame, per_frame, width)  # each frame
            block += count * per_frame * attention(frames, frames, width)  # each position
        else:
            block += count * attention(tokens, tokens, width)
        block += count * attention(tokens, TEXT_TOKENS, width)
    flops += layers * block
    return (
        flops + linear(samples + 1, width, 2 * width) + linear(sequence, width, VIDEO_PATCH_VALUES)
    )


def video_parameters(width: int, layers: int, heads: int, text_dim: int, pooled: int) -> int:
    """Parameters of the ``cross`` DiT with full attention, patch 2 over 8 latent channels."""
    attention_weights = 4 * (width * width + width) + 2 * (width // heads)  # + q, k RMSNorms
    mlp = (4 * width * width + 4 * width) + (4 * width * width + width)
    block = 2 * attention_weights + mlp + 9 * width * width + 9 * width
    embedders = (VIDEO_PATCH_VALUES + 1) * width
    for fan_in in (FREQUENCIES, pooled, text_dim):
        embedders += (fan_in + 1) * width + (width + 1) * width
    final = (2 * width * width + 2 * width) + (width * VIDEO_PATCH_VALUES + VIDEO_PATCH_VALUES)
    return layers * block + embedders + final


def test_the_tiny_video_estimate_counts_every_clip_frame_in_its_flops():
    """The default mix: 17, 13 and 9-frame clips and images at 64² through the demo video VAE
    (5, 4, 3 and 1 latent frames of 4x4 patches), 9 of each: the frame axis multiplies the
    tokens, and full attention is quadratic in each clip's tokens."""
    report = run_bench("dit-video-tiny", estimate=True, device="cpu")
    shapes = [(s["frames"], s["height"], s["images"], s["tokens"]) for s in report["shapes"]]
    assert shapes == [(17, 64, 9, 80), (13, 64, 9, 64), (9, 64, 9, 48), (1, 64, 9, 16)]
    assert report["clips"] and report["image_tokens"] == 9 * (80 + 64 + 48 + 16) == 1872
    assert report["sequence_tokens"] == {"packed": 1920, "padded": 2944}  # 36 × 80, to 128
    assert report["layouts"] == ["padded", "packed"]
    clips = [(9, 5, 16), (9, 4, 16), (9, 3, 16), (9, 1, 16)]
    assert report["flops_per_step"] == video_step_flops(*TINY, clips, 1872)
    assert report["packed_flops_per_step"] == video_step_flops(*TINY, clips, 1920)
    assert report["padded_flops_per_step"] == video_step_flops(*TINY, clips, 2944)
    assert report["trained_parameters"] == video_parameters(128, 6, 4, 64, 32)
    text = format_report(report)
    assert "36 samples (9 × 17 frames of 64x64, 80 tokens, " in text
    assert "9 × 1 frame of 64x64, 16 tokens): 1872 sample tokens" in text


def test_spatiotemporal_attention_counts_frames_and_positions_apart():
    """``model.dit.attention: spatiotemporal``: spatial attention within each frame, temporal
    attention within each patch position across the frames (an image's tokens each alone),
    and the temporal branch's q, k, v, out and 3 modulation vectors per block."""
    report = run_bench(
        "dit-video-tiny", estimate=True, device="cpu", frames=[17, 5, 1], batch=3,
        overrides=["model.dit.attention=spatiotemporal"],
    )  # fmt: skip
    assert [s["tokens"] for s in report["shapes"]] == [80, 32, 16]
    clips = [(1, 5, 16), (1, 2, 16), (1, 1, 16)]
    assert report["flops_per_step"] == video_step_flops(*TINY, clips, 128, "spatiotemporal")
    assert report["padded_flops_per_step"] == video_step_flops(*TINY, clips, 256, "spatiotemporal")
    temporal = 6 * (4 * (128 * 128 + 128) + 2 * 32 + 3 * 128 * 128 + 3 * 128)
    assert report["trained_parameters"] == video_parameters(128, 6, 4, 64, 32) + temporal


def test_the_7b_video_estimate_is_the_seeds_8k_token_clip():
    """NeMo's 7B DiT at its 8k context: one clip of 125 frames at 256² (32 latent frames of
    16x16 patches: 8192 tokens), full attention; nothing to pad, so packed alone."""
    report = run_bench("dit-7b-video", estimate=True, device="cpu")
    assert report["model"] == "dit-7b-video" and report["resolution"] == 256
    assert [(s["frames"], s["images"], s["tokens"]) for s in report["shapes"]] == [(125, 1, 8192)]
    assert report["sequence_tokens"] == {"packed": 8192, "padded": 8192}
    assert report["layouts"] == ["packed"]
    flops = video_step_flops(*SEVEN_B, [(1, 32, 256)], 8192)
    assert report["flops_per_step"] == flops == report["packed_flops_per_step"]
    assert report["flops_per_token"] == pytest.approx(35.2e9, rel=2e-3)  # 27.0 at 256 tokens
    parameters = video_parameters(3072, 32, 24, 2048, 1280)
    assert report["trained_parameters"] == parameters
    memory = report["memory_gib"]  # fp32 weights and gradients, AdamW's two moments
    assert memory["trained_total"] * 2**30 == pytest.approx(16 * parameters, rel=1e-6)
    text = format_report(report)
    assert "1 sample (1 × 125 frames of 256x256, 8192 tokens): 8192 sample tokens" in text
    assert "35.2 GFLOP per sample token" in text and "padded layout is the same" in text


def test_the_tiny_video_bench_times_packed_against_padded_clips():
    """Two clips' shapes (9 frames: 48 tokens, an image: 16) in packs of 128 tokens: both
    layouts timed, interleaved, every row counting the samples' FLOPs."""
    report = run_bench("dit-video-tiny", frames=[9, 1], batch=2, steps=1, warmup=0, rounds=2,
                       device="cpu")  # fmt: skip
    assert report["image_tokens"] == 64 and report["sequence_tokens"]["packed"] == 128
    rows = {(row["variant"], row["layout"]): row for row in report["rows"]}
    assert list(rows) == [("default", "padded"), ("default", "packed")]
    for row in rows.values():
        assert row["tokens_per_s"] == pytest.approx(64e3 / row["step_ms"])
        assert row["tflops"] == pytest.approx(report["flops_per_step"] / row["step_ms"] / 1e9)
    (ratio,) = report["ratios"]
    assert ratio["median"] == rows["default", "packed"]["vs_padded"]
    assert len(ratio["rounds"]) == 2


def test_on_a_gpu_a_variant_too_large_is_reported_and_the_others_run(monkeypatch):
    """A card that holds adafactor's weights (no kept gradients, factored moments) but not
    default's weights, gradients and AdamW moments: default's rows say so (nothing built),
    adafactor is timed; none fitting is one line."""
    from impasto.bench.packed import check_fits, plan_bench

    plan = plan_bench("dit", "video-tiny", None, 2, "auto", ("default", "adafactor"), "cpu",
                      (), (9, 1))  # fmt: skip
    default, low = plan.states["default"].state_bytes, plan.states["adafactor"].state_bytes
    assert low < default / 3  # fp32 weights alone: 4 of default's 16 bytes per parameter

    class Card:
        total_memory = (low + default) // 2

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Card())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a small card")
    skipped = check_fits(plan, torch.device("cuda"))
    assert set(skipped) == {("default", "padded"), ("default", "packed")}
    assert skipped["default", "packed"].startswith("does not fit: ")
    Card.total_memory = low // 2
    with pytest.raises(ValueError, match="more than the .* of a small card; see --estimate, try"):
        check_fits(plan, torch.device("cuda"))


def test_cli_takes_the_video_models_and_checks_frames(capsys):
    assert main(["bench", "--model", "dit-huge"]) == 2
    assert "dit-28b, dit-video-tiny, dit-7b-video" in capsys.readouterr().err
    assert main(["bench", "--model", "dit-video-tiny", "--frames", "16", "--estimate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--frames 16 at --resolution 64: a clip of 16 frames" in err
    assert "e.g. 13 or 17" in err
    assert main(["bench", "--model", "dit-video-tiny", "--frames", "9", "9", "--estimate"]) == 2
    assert "names a count twice" in capsys.readouterr().err
    assert main(["bench", "--model", "dit-video-tiny", "--batch", "6", "--estimate"]) == 2
    assert "clips of each of the 4 frame counts; use a multiple of 4" in capsys.readouterr().err
    assert main(["bench", "--model", "dit-tiny", "--frames", "9", "--estimate"]) == 2
    err = capsys.readouterr().err
    assert "--frames is for the video models (dit-video-tiny, dit-7b-video" in err
    assert "); dit-tiny trains on images" in err  # other families' video models may follow
    assert main(["bench", "--model", "tiny", "--frames", "9"]) == 2
    assert "--frames is for the video models, not tiny" in capsys.readouterr().err
