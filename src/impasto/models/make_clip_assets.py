"""Regenerate the bundled CLIP BPE tokenizer files in ``impasto/assets/clip/``.

The OpenAI CLIP tokenizer (MIT license, https://github.com/openai/CLIP) ships one gzipped BPE
file, ``bpe_simple_vocab_16e6.txt.gz``; open_clip_torch redistributes it in its PyPI wheel. This
script turns it into the ``vocab.json`` / ``merges.txt`` pair that ``transformers.CLIPTokenizer``
reads, building the vocabulary exactly as OpenAI's ``simple_tokenizer.py`` does (the same files
as Hugging Face ``openai/clip-vit-large-patch14``):

    vocab = bytes_to_unicode chars (256) + the same with "</w>" (256) + joined merges (48894)
            + "<|startoftext|>" (49406) + "<|endoftext|>" (49407)

How to regenerate (offline apart from PyPI)::

    pip download open_clip_torch==3.3.0 --no-deps -d /tmp/oc
    python -m impasto.models.make_clip_assets /tmp/oc/open_clip_torch-3.3.0-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import gzip
import json
import zipfile
from pathlib import Path

BPE_MEMBER = "open_clip/bpe_simple_vocab_16e6.txt.gz"
# simple_tokenizer.py: merges = merges[1 : 49152 - 256 - 2 + 1]
NUM_MERGES = 49152 - 256 - 2
MERGES_HEADER = "#version: 0.2"
DEFAULT_OUT_DIR = Path(__file__).resolve().parent.parent / "assets" / "clip"


def bytes_to_unicode() -> dict[int, str]:
    """Map every byte to a printable unicode char (OpenAI CLIP ``simple_tokenizer.py``, GPT-2)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, [chr(code) for code in codes], strict=True))


def read_bpe_lines(wheel_path: Path) -> list[str]:
    """Return the decoded lines of the BPE file inside an open_clip_torch wheel."""
    with zipfile.ZipFile(wheel_path) as wheel:
        text = gzip.decompress(wheel.read(BPE_MEMBER)).decode("utf-8")
    return text.split("\n")


def build_vocab_and_merges(bpe_lines: list[str]) -> tuple[dict[str, int], list[str]]:
    """Build the CLIP ``vocab`` (token -> id, 49408 entries) and the 48894 merge lines."""
    # Line 0 is the "#version" header (prefixed by gzip's stored file name); skip it.
    merges = bpe_lines[1 : NUM_MERGES + 1]
    if len(merges) != NUM_MERGES or any(len(m.split()) != 2 for m in merges):
        raise ValueError(f"unexpected BPE file: {len(merges)} merges, expected {NUM_MERGES}")
    tokens = list(bytes_to_unicode().values())
    tokens += [token + "</w>" for token in tokens]
    tokens += ["".join(merge.split()) for merge in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("duplicate tokens in the CLIP vocabulary")
    return vocab, merges


def write_assets(wheel_path: Path, out_dir: Path = DEFAULT_OUT_DIR) -> None:
    """Write ``vocab.json`` and ``merges.txt`` to ``out_dir``."""
    vocab, merges = build_vocab_and_merges(read_bpe_lines(wheel_path))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out_dir / "merges.txt").write_text(
        "\n".join([MERGES_HEADER, *merges]) + "\n", encoding="utf-8"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Write CLIP vocab.json and merges.txt.")
    parser.add_argument("wheel", type=Path, help="path to an open_clip_torch wheel")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    args = parser.parse_args()
    write_assets(args.wheel, args.out_dir)


if __name__ == "__main__":
    main()
