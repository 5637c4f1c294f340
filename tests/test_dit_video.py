"""The DiT's frame axis: clips ``[B, C, F, h, w]``, 3-D patches (``model.dit.frame_patch``), and
the three self-attention layouts (``model.dit.attention``: full, spatiotemporal, alternating),
dense and packed, against a reference written with explicit loops over samples, frames and
patch positions."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import yaml

from impasto.models.dit.layers import apply_rope, rope_rotation, timestep_features
from impasto.models.dit.layout import partition, patchify, plan_pack, unpatchify
from impasto.models.dit.network import DiT, DiTConfig

LAYOUTS = ["full", "spatiotemporal", "alternating"]
# (count, frames or None for 4-D images, h, w): images and clips of several lengths and sizes
PACK_SHAPES = [(2, None, 8, 8), (1, 3, 8, 8), (2, 2, 4, 8), (1, None, 8, 16), (1, 1, 8, 8)]


def _network(seed: int = 0, dtype: torch.dtype = torch.float64, **options) -> DiT:
    """A tiny DiT whose zero-initialised layers are not zero (every branch reaches the output)."""
    torch.manual_seed(seed)
    network = DiT(DiTConfig(**options)).to(dtype)
    with torch.no_grad():
        for parameter in network.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return network.eval()


def _conditions(config: DiTConfig, count: int, seed: int = 2, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    times = torch.rand(count, generator=generator) * 1000  # every sample its own time
    text = torch.randn(count, 7, config.text_dim, generator=generator, dtype=dtype)
    pooled = torch.randn(count, config.pooled_dim, generator=generator, dtype=dtype)
    return times, text, pooled


def _latents(count: int, frames: int | None, h: int, w: int, seed: int, dtype=torch.float64):
    shape = (count, 4, h, w) if frames is None else (count, 4, frames, h, w)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# -- the reference: one sample, one frame, one patch position at a time -----------------------
def _attend(module, x, pairs, rope=None, context=None):
    """``module``'s attention with softmax by hand; ``pairs``: (query rows, key rows) of each
    group that attends among itself."""
    source = x if context is None else context
    head_dim = module.head_dim
    query = module.norm_q(module.to_q(x).unflatten(-1, (-1, head_dim)))[0]  # [S, H, Dh]
    key = module.norm_k(module.to_k(source).unflatten(-1, (-1, head_dim)))[0]
    value = module.to_v(source).unflatten(-1, (-1, head_dim))[0]
    if rope is not None:
        query, key = apply_rope(query[None], rope)[0], apply_rope(key[None], rope)[0]
    out = torch.zeros_like(query)
    for rows, keys in pairs:
        for head in range(query.shape[1]):
            scores = query[rows, head] @ key[keys, head].T / math.sqrt(head_dim)
            out[rows, head] = torch.softmax(scores, dim=-1) @ value[keys, head]
    return module.to_out(out.flatten(1)[None])


def _groups(cells: list[tuple[int, int, int]], axes: tuple[int, ...]):
    """(rows, rows) of the tokens that share ``cells``' values on ``axes``."""
    keys: dict[tuple[int, ...], list[int]] = {}
    for index, cell in enumerate(cells):
        keys.setdefault(tuple(cell[axis] for axis in axes), []).append(index)
    return [(torch.tensor(rows), torch.tensor(rows)) for rows in keys.values()]


def _reference_sample(network: DiT, clip, time, text, pooled):
    """One sample's prediction ``[C, F, h, w]`` from the network's own layers."""
    config = network.config
    p, pt = config.patch_size, config.frame_patch
    channels, frames, height, width = clip.shape
    cells = [(f, r, c) for f in range(frames // pt)
             for r in range(height // p) for c in range(width // p)]  # fmt: skip
    tokens = torch.stack([clip[:, f * pt : (f + 1) * pt, r * p : (r + 1) * p,
                               c * p : (c + 1) * p].reshape(-1) for f, r, c in cells])  # fmt: skip
    rope = rope_rotation(torch.tensor(cells)[None], config.head_dim)
    x = network.patch_embed(tokens)[None]
    condition = network.time_embed(timestep_features(time).to(x.dtype))
    condition = torch.nn.functional.silu(condition + network.pooled_embed(pooled))
    context = network.text_embed(text) if config.has_text_tokens else None
    everything = [(torch.arange(len(cells)), torch.arange(len(cells)))]
    spatial, temporal = _groups(cells, (0,)), _groups(cells, (1, 2))
    for index, block in enumerate(network.blocks):
        chunks = block.modulation(condition)[:, None].chunk(block.num_modulations, dim=-1)
        shift1, scale1, gate1, shift2, scale2, gate2 = chunks[:6]
        pairs = {"full": everything, "spatiotemporal": spatial,
                 "alternating": temporal if index % 2 else spatial}[config.attention]  # fmt: skip
        normed = block.norm1(x) * (1 + scale1) + shift1
        x = x + gate1 * _attend(block.attn, normed, pairs, rope)
        if config.attention == "spatiotemporal":  # its own shift, scale, gate: the last three
            shift_t, scale_t, gate_t = chunks[-3:]
            normed = block.norm_temporal(x) * (1 + scale_t) + shift_t
            x = x + gate_t * _attend(block.attn_temporal, normed, temporal, rope)
        text_pairs = [(torch.arange(len(cells)), torch.arange(text.shape[1]))]
        if config.block == "cross":
            shift_c, scale_c, gate_c = chunks[6:9]
            normed = block.norm_cross(x) * (1 + scale_c) + shift_c
            x = x + gate_c * _attend(block.cross, normed, text_pairs, context=context)
        elif config.block == "llama":
            x = x + _attend(block.cross, block.norm_cross(x), text_pairs, context=context)
        x = x + gate2 * block.mlp(block.norm2(x) * (1 + scale2) + shift2)
    shift, scale = network.final.modulation(condition)[:, None].chunk(2, dim=-1)
    values = network.final.linear(network.final.norm(x) * (1 + scale) + shift)[0]
    out = torch.zeros_like(clip)
    for (f, r, c), patch in zip(cells, values, strict=True):
        out[:, f * pt : (f + 1) * pt, r * p : (r + 1) * p, c * p : (c + 1) * p] = patch.reshape(
            channels, pt, p, p
        )
    return out


def _reference(network: DiT, latents, times, text, pooled):
    clips = latents if latents.dim() == 5 else latents[:, :, None]
    out = torch.stack([
        _reference_sample(network, clips[i], times[i : i + 1], text[i : i + 1], pooled[i : i + 1])
        for i in range(latents.shape[0])
    ])  # fmt: skip
    return out if latents.dim() == 5 else out[:, :, 0]


@pytest.mark.parametrize(
    ("attention", "block", "frame_patch"),
    [(layout, block, 1) for layout in LAYOUTS for block in ("adaln", "cross", "llama")]
    + [("spatiotemporal", "cross", 2), ("alternating", "llama", 2)],
)
def test_each_layout_equals_a_reference_with_loops_over_frames_and_positions(
    attention, block, frame_patch
):
    network = _network(attention=attention, block=block, frame_patch=frame_patch)
    latents = _latents(2, 3 * frame_patch, 4, 6, seed=1)  # 3 token frames of 2 x 3 patches
    times, text, pooled = _conditions(network.config, 2)
    with torch.no_grad():
        got = network(latents, times, text, pooled)
        want = _reference(network, latents, times, text, pooled)
    assert got.shape == latents.shape
    torch.testing.assert_close(got, want)
    assert (got[0] - got[1]).abs().max() > 1e-3  # the samples' times and texts reach it


def test_layouts_differ_and_an_image_is_a_one_frame_clip():
    """With the same weights, full and alternating attention predict differently on a clip
    (the restriction matters); on an image a 4-D input and the same 5-D one-frame clip give
    identical predictions."""
    full = _network(attention="full")
    alternating = _network(attention="alternating")
    assert full.state_dict().keys() == alternating.state_dict().keys()
    clip = _latents(1, 3, 4, 6, seed=1)
    times, text, pooled = _conditions(full.config, 1)
    with torch.no_grad():
        difference = full(clip, times, text, pooled) - alternating(clip, times, text, pooled)
    assert difference.abs().max() > 1e-3
    image = _latents(2, None, 8, 8, seed=3)
    times, text, pooled = _conditions(full.config, 2)
    for layout in LAYOUTS:
        network = _network(attention=layout, dtype=torch.float32)
        with torch.no_grad():
            flat = network(image.float(), times, text.float(), pooled.float())
            one_frame = network(image.float()[:, :, None], times, text.float(), pooled.float())
        assert one_frame.shape == (2, 4, 1, 8, 8)
        assert torch.equal(one_frame[:, :, 0], flat), layout


def _pack_inputs(config: DiTConfig):
    groups = [_latents(n, f, h, w, seed=10 + i) for i, (n, f, h, w) in enumerate(PACK_SHAPES)]
    times, text, pooled = _conditions(config, sum(n for n, *_ in PACK_SHAPES))
    return groups, times, text, pooled


def _alone(network: DiT, groups, times, text, pooled) -> list[torch.Tensor]:
    """Each sample through a dense forward of its own."""
    outputs, start = [], 0
    for group in groups:
        rows = [network(group[i : i + 1], *(t[start + i : start + i + 1] for t in (times, text,
                                                                                  pooled)))
                for i in range(group.shape[0])]  # fmt: skip
        outputs.append(torch.cat(rows))
        start += group.shape[0]
    return outputs


@pytest.mark.parametrize("kernel", ["grouped", "sdpa", "flex"])
@pytest.mark.parametrize("attention", LAYOUTS)
def test_a_pack_of_images_and_clips_predicts_what_each_sample_alone_does(attention, kernel):
    network = _network(attention=attention)
    groups, times, text, pooled = _pack_inputs(network.config)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FlexAttention's eager fallback on the CPU
        packed = network(groups, times, text, pooled, kernel=kernel)  # 160 tokens in 256
        alone = _alone(network, groups, times, text, pooled)
    for got, want in zip(packed, alone, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("kernel", ["grouped", "sdpa"])
def test_a_packs_gradients_are_each_samples_and_checkpointing_keeps_them(kernel):
    network = _network(attention="spatiotemporal").train()
    groups, times, text, pooled = _pack_inputs(network.config)

    def gradients(run) -> dict[str, torch.Tensor]:
        network.zero_grad()
        sum(prediction.square().sum() for prediction in run()).backward()
        return {name: p.grad.clone() for name, p in network.named_parameters()}

    packed = gradients(lambda: network(groups, times, text, pooled, kernel=kernel))
    alone = gradients(lambda: _alone(network, groups, times, text, pooled))
    torch.testing.assert_close(packed, alone)
    assert packed["blocks.0.attn_temporal.to_q.weight"].abs().sum() > 0
    network.enable_gradient_checkpointing()
    checkpointed = gradients(lambda: network(groups, times, text, pooled, kernel=kernel))
    torch.testing.assert_close(checkpointed, packed)


def test_temporal_groups_of_a_pack_gather_each_patch_position_across_frames():
    pack = plan_pack([(2, 1, 2), (2, 2)], capacity=None, device=torch.device("cpu"))
    assert pack.grids == ((2, 1, 2), (1, 2, 2)) and pack.num_tokens == 8
    temporal = partition(pack, "temporal")
    # clip: tokens (f, c) = 0:(0,0) 1:(0,1) 2:(1,0) 3:(1,1); then the image's 4, padding
    assert temporal.ids[:8].tolist() == [0, 1, 0, 1, 2, 3, 4, 5]
    assert temporal.order[:8].tolist() == [0, 2, 1, 3, 4, 5, 6, 7]
    assert temporal.lengths == (2, 2, 1, 1, 1, 1) and (temporal.ids[8:] == 6).all()
    assert torch.equal(temporal.order[temporal.inverse], torch.arange(pack.capacity))
    spatial = partition(pack, "spatial")
    assert spatial.ids[:8].tolist() == [0, 0, 1, 1, 2, 2, 2, 2] and spatial.order is None


def test_the_token_multiple_route_packs_a_clip_that_does_not_split():
    network = _network(attention="spatiotemporal")
    clip = _latents(2, 3, 4, 6, seed=1)  # 18 tokens: not a multiple of 4
    times, text, pooled = _conditions(network.config, 2)
    with torch.no_grad():
        dense = network(clip, times, text, pooled)
        network.token_multiple = 4
        packed = network(clip, times, text, pooled)
    torch.testing.assert_close(packed, dense)


def test_a_new_spatiotemporal_network_predicts_zero_through_adaln_zero_gates():
    torch.manual_seed(0)
    network = DiT(DiTConfig(attention="spatiotemporal"))
    clip = _latents(2, 3, 8, 8, seed=1, dtype=torch.float32)
    times, text, pooled = _conditions(network.config, 2, dtype=torch.float32)
    assert network(clip, times, text, pooled).abs().max() == 0
    block = network.blocks[0]
    assert block.attn_temporal.to_out.weight.abs().sum() > 0  # gated, not zeroed
    assert block.modulation.out_features == 12 * network.config.hidden_size
    x = torch.randn(2, 48, network.config.hidden_size)
    condition = torch.randn(2, network.config.hidden_size)
    context = torch.randn(2, 7, network.config.hidden_size)
    from impasto.models.dit.attention import dense_attends

    attends = dense_attends(3, 16)
    inputs = (x, condition, None, context, attends["spatial"], attends["full"])
    torch.testing.assert_close(block(*inputs, attend_temporal=attends["temporal"]), x)
    with torch.no_grad():  # open the temporal gate (the last of the 12 vectors) alone
        block.modulation.bias[-network.config.hidden_size :] = 1.0
    assert (block(*inputs, attend_temporal=attends["temporal"]) - x).abs().max() > 1e-3


def test_frame_patch_2_round_trips_and_refuses_what_it_cannot_split():
    latents = torch.arange(2 * 3 * 4 * 4 * 6, dtype=torch.float32).reshape(2, 3, 4, 4, 6)
    tokens = patchify(latents, 2, frame_patch=2)
    assert tokens.shape == (2, 2 * 2 * 3, 3 * 2 * 2 * 2)
    # token 7 = 1·6 + 0·3 + 1: frame 1 (latent frames 2:4), row 0, column 1 (pixels [0:2, 2:4])
    assert tokens[0, 7].tolist() == latents[0, :, 2:4, 0:2, 2:4].reshape(-1).tolist()
    back = unpatchify(tokens, 2, 3, 2, 3, frames=2, frame_patch=2)
    torch.testing.assert_close(back, latents, rtol=0, atol=0)
    network = _network(frame_patch=2, attention="spatiotemporal")
    assert network.patch_embed.in_features == 4 * 2 * 2 * 2
    times, text, pooled = _conditions(network.config, 1)
    with pytest.raises(ValueError, match=r"^model\.dit\.frame_patch 2 does not divide .* 3 frames"):
        network(_latents(1, 3, 4, 4, seed=1), times, text, pooled)
    with pytest.raises(ValueError, match=r"^model\.dit\.frame_patch 2 does not divide .* 1 frames"):
        network(_latents(1, None, 4, 4, seed=1), times, text, pooled)  # an image
    with pytest.raises(ValueError, match=r"^model\.dit\.position sincos"):
        _network(position="sincos")(_latents(1, 2, 4, 4, seed=1), times, text, pooled)


def test_frame_patch_1_keeps_the_image_weight_shapes():
    """Exported image DiTs load: the new fields add no parameter at their defaults."""
    shapes = {name: p.shape for name, p in _network().state_dict().items()}
    assert shapes["patch_embed.weight"] == (128, 4 * 2 * 2)
    assert shapes["final.linear.weight"] == (4 * 2 * 2, 128)
    assert not any("temporal" in name for name in shapes)
    alternating = _network(attention="alternating").state_dict()
    assert {name: p.shape for name, p in alternating.items()} == shapes


def test_video_fields_round_trip_through_an_exported_folder(tiny_raw, tmp_path):
    from test_video_vae import tiny_wan_vae

    from impasto.config import build_config
    from impasto.models import build_backbone
    from impasto.models.dit.files import save_dit_folder
    from impasto.models.exported import RECORD_FILE

    tiny_wan_vae(0).save_pretrained(tmp_path / "wan", safe_serialization=True)
    options = {"attention": "spatiotemporal", "frame_patch": 2, "kernel": "sdpa",
               "autoencoder": "video"}  # fmt: skip
    tiny_raw["model"] = {"family": "dit", "preset": "tiny", "dit": options,
                         "vae": str(tmp_path / "wan")}  # fmt: skip
    backbone = build_backbone(build_config(tiny_raw))
    config = backbone.components.transformer.config
    assert (config.attention, config.frame_patch, backbone.kernel) == ("spatiotemporal", 2, "sdpa")
    # 13 frames: 4 latent frames, 2 token frames of 4x4 patches at 64 px
    assert backbone.sequence_length(64, 64, frames=13) == 2 * 4 * 4
    with pytest.raises(ValueError, match=r"^model\.dit\.frame_patch 2 does not divide the 3 "):
        backbone.sequence_length(64, 64, frames=9)
    with pytest.raises(ValueError, match=r"takes k·4\+1 frames .* e\.g\. 9 or 13"):
        backbone.sequence_length(64, 64, frames=10)
    targets = backbone.adapter_targets("transformer", "attention")
    assert "blocks.0.attn_temporal.to_q" in targets and "blocks.5.attn_temporal.to_out" in targets
    plan = backbone.tensor_parallel_plan()
    block = plan.blocks[0]
    for name in ("attn_temporal.to_q", "attn_temporal.to_v"):
        assert name in plan.colwise and block.get_submodule(name) is not None
    assert "attn_temporal.to_out" in plan.rowwise and "attn_temporal" in plan.gathers
    record = {"family": "dit", "objective": {"prediction_type": "flow"}, "resolution": 64}
    folder = save_dit_folder(backbone, tmp_path / "dit", record, torch.float32)
    saved = json.loads((folder / RECORD_FILE).read_text())["transformer"]
    assert (saved["attention"], saved["frame_patch"]) == ("spatiotemporal", 2)
    tiny_raw["model"] = {"family": "dit", "path": str(folder)}
    tiny_raw["objective"] = {"prediction_type": "flow"}
    loaded = build_backbone(build_config(tiny_raw))
    assert loaded.components.transformer.config == config
    want, got = backbone.denoiser().state_dict(), loaded.denoiser().state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # a record written before the frame axis (no attention, no frame_patch) reads the defaults
    old = {key: value for key, value in saved.items() if key not in ("attention", "frame_patch")}
    assert (DiTConfig(**old).attention, DiTConfig(**old).frame_patch) == ("full", 1)


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        ({"attention": "flex"}, ("model.dit.attention", "set model.dit.kernel: flex")),
        ({"attention": "grouped"}, ("model.dit.attention", "model.dit.kernel: grouped")),
        ({"attention": "temporal"}, ("model.dit.attention", "full", "spatiotemporal")),
        ({"frame_patch": 3}, ("model.dit.frame_patch", "1 or 2")),
        ({"kernel": "spatiotemporal"}, ("model.dit.kernel", "grouped")),
    ],
)
def test_bad_video_options_are_one_line_naming_the_key(
    tiny_raw, tmp_path, capsys, options, fragments
):
    from impasto.cli import main

    tiny_raw["model"] = {"family": "dit", "preset": "tiny", "dit": options}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tiny_raw))
    assert main(["train", str(path), "--print-config"]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("impasto: error:")]
    assert len(errors) == 1 and captured.out == "", captured.err
    assert all(fragment in errors[0] for fragment in fragments), errors[0]
