"""Frozen text encoders released once every text a run needs is encoded (issue #33: "cached
text encodings (T5 encoded once, then unloaded)"): a run then trains without the 9 GiB
of T5-XXL.

With ``cache.text_embeddings`` on, a family that routes every text encoding through
``encode_text`` (:class:`ReleasableText`: its ``sampling_condition`` calls it too) has its
frozen text encoders released after start-up, in this order:

1. every caption a step or the validation loss can meet is encoded, one at a time, as
   :class:`~impasto.train.memo.EncodingMemo` encodes it (under the run's autocast): the
   dataset's captions after its caption tools (``memory``; the disk cache holds them for
   ``disk``), the empty caption (``data.caption_dropout``), the held-out sets' captions;
2. the validation prompts and their negative prompts (and the empty one), as sampling encodes
   them (no autocast);
3. the backbone's ``text_table`` (which its ``encode_text`` consults first) becomes that
   table (:class:`CachedText`), and
   the encoders' weights move to the meta device (freed on the host and the GPU).

A text outside the table (a disk-cache entry found damaged mid-run, a new prompt) then stops
with one line naming the way out; exporting a full model rebuilds it from the run's config and
reads the encoders' files again. Captions that change every epoch (``data.shuffle_tags`` or
``data.tag_dropout`` with ``cache.text_embeddings: memory``) cannot be listed: the encoders
stay, and the run says why. Methods that generate from prompts (DRaFT+) keep them.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from impasto.models.backbone import Backbone, split_rows, stack_rows

RELEASE_NOTE = "text encoders released after caching (cache.text_embeddings)"


@runtime_checkable
class ReleasableText(Protocol):
    """A backbone whose text encodings, training and sampling, all come from ``encode_text``,
    which reads ``text_table`` first when one is set (so a table can stand in for its
    encoders), with its text encoders by part name."""

    text_table: Callable[[list[str]], Any] | None

    def text_encoders(self) -> dict[str, nn.Module]: ...


def releasable_encoders(
    backbone: Any, trained: Iterable[str], cached: bool
) -> dict[str, nn.Module]:
    """The text encoders a run lets go after caching: none without cached text (``cached``:
    ``cache.text_embeddings`` is on) or for a family that is not :class:`ReleasableText`; else
    its encoders that do not train (``trained``: the trained part names)."""
    if not cached or not isinstance(backbone, ReleasableText):
        return {}
    skip = set(trained)
    return {name: module for name, module in backbone.text_encoders().items() if name not in skip}


class CachedText:
    """``encode_text`` of a backbone whose text encoders were released: the rows of
    ``table`` (caption → one row of the encoding, on the CPU) stacked on ``device()``."""

    def __init__(self, table: dict[str, Any], device: Callable[[], torch.device]) -> None:
        self.table = table
        self.device = device

    def __call__(self, captions: list[str]) -> Any:
        missing = [caption for caption in dict.fromkeys(captions) if caption not in self.table]
        if missing:
            raise ValueError(
                f"text {missing[0][:60]!r} was not encoded before the {RELEASE_NOTE}; refill "
                "a damaged disk cache with impasto cache CONFIG, or sample new prompts with "
                "impasto sample"
            )
        return stack_rows([self.table[caption] for caption in captions], self.device())


def dataset_captions(dataset: Any) -> list[str] | None:
    """Every caption ``dataset`` (an ``ImageCaptionDataset``) can hand out, or None when its
    caption tools draw new ones each epoch (shuffle or tag dropout without cached variants)."""
    tools, variants = dataset.caption_tools, dataset.caption_variants
    if tools.random and not variants:
        return None
    captions = [""] if dataset.caption_dropout > 0 else []
    for index, record in enumerate(dataset.records):
        if variants:
            seed = dataset.seed
            captions += [tools.variant(record.caption, seed, v, index) for v in range(variants)]
        else:
            captions.append(tools.apply(record.caption, torch.Generator()))
    return captions


def sampling_texts(prompts: Sequence[Any], negative_prompt: str) -> list[str]:
    """The validation prompts (``SamplePrompt``), their negative prompts and the empty one."""
    texts = [prompt.text for prompt in prompts] + ["", negative_prompt]
    return texts + [p.options.negative_prompt for p in prompts if p.options.negative_prompt]


def fill_table(
    table: dict[str, Any], backbone: Backbone, texts: Iterable[str],
    context: Callable[[], AbstractContextManager],
) -> None:  # fmt: skip
    """Encode each text not in ``table`` alone (a batch of one, as the memo does) into it."""
    for text in dict.fromkeys(texts):
        if text not in table:
            with torch.no_grad(), context():
                table[text] = split_rows(backbone.encode_text([text]))[0]


def free(modules: Iterable[nn.Module]) -> int:
    """Move ``modules``' tensors to the meta device; returns the bytes freed."""
    freed = 0
    for module in modules:
        tensors = [*module.parameters(), *module.buffers()]
        freed += sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")
        module.to("meta")
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return freed


def release_text_encoders(setup: Any, config: Any, data: Any, prompts: Sequence[Any]) -> list[str]:
    """Encode what the run needs, then release its frozen text encoders (module docstring);
    ``setup``: the trainer's :class:`~impasto.train.setup.StepSetup`, ``data``: its
    ``RunData``, ``prompts``: the validation prompts. Returns the released parts' names."""
    backbone = setup.backbone
    cached = config.cache.text_embeddings != "none"
    encoders = releasable_encoders(backbone, setup.trainable, cached)
    if not encoders or not hasattr(data.stream, "loader"):  # a prompts-only method: kept
        return []
    captions = [] if config.cache.text_embeddings == "disk" else None
    if captions is None:
        captions = dataset_captions(data.stream.loader.dataset)
        if captions is None:
            print(
                "impasto: text encoders kept: data.shuffle_tags / data.tag_dropout make new "
                "captions every epoch; cache.text_embeddings: disk caches variants instead"
            )
            return []
    for held_out in data.eval_sets:
        captions += dataset_captions(held_out.dataset) or []
    memo = getattr(setup.method, "memo", None)
    table: dict[str, Tensor] = memo.texts if memo is not None else {}
    fill_table(table, backbone, ["", *captions], setup.autocast)
    fill_table(table, backbone, sampling_texts(prompts, config.sample.negative_prompt), nullcontext)
    backbone.text_table = CachedText(table, lambda: backbone.device)
    freed = free(encoders.values())
    print(
        f"impasto: {', '.join(encoders)} released after encoding {len(table)} texts "
        f"({freed / 2**30:.2f} GiB; cache.text_embeddings)"
    )
    return list(encoders)
