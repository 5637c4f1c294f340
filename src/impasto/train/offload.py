"""Block offload: train the SDXL UNet with its down/mid/up blocks kept in CPU memory.

The master copy of each offloaded block's parameters lives on the CPU (pinned when the device is
CUDA, so copies are asynchronous DMA). A block's weights are copied to the device just before it
runs and dropped right after, and the next block's copy is issued on a side stream while the
current block computes (docs/offload.md has the timeline, the memory and the PCIe cost).

Backward is checkpoint-style, as in ``torch.utils.checkpoint(use_reentrant=True)``: an offloaded
block runs inside a custom autograd Function that saves only its input activations. Its backward
loads the weights again (prefetched by the block after it), recomputes the block with the same
autocast and RNG state, differentiates the recomputation, and sends the weight gradients back to
the CPU on a second side stream. They are added to the CPU masters' ``.grad`` (fp32 for fp32
masters) when the whole backward pass ends, like FSDP's ``CPUOffload(offload_params=True)`` and
ZeRO-Offload (Ren et al., arXiv:2101.06840), so the optimizer steps on the CPU. diffusers' group
offloading (``apply_group_offloading``) is not reused: it swaps ``param.data`` in forward hooks
and covers inference only; autograd would find CPU weights in backward.

At most two offloaded blocks' weights exist on the device at a time (the one computing and the
one being fetched); in backward the computing block's weight gradients come on top.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten


@dataclass(eq=False)
class _Block:
    """One offloaded block: its CPU masters and where each sits in the block's modules."""

    name: str
    module: nn.Module
    masters: list[nn.Parameter]
    slots: list[tuple[nn.Module, str, int]]  # (owner, attribute, index into masters)
    forward: Any  # the block's own forward, called with the device weights swapped in

    @property
    def num_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.masters)


@dataclass(eq=False)
class _Loaded:
    """A block's weights on the device; ``ready``: CUDA event of their copy (None: copied)."""

    weights: list[Tensor]
    ready: torch.cuda.Event | None


@dataclass(eq=False)
class _Call:
    """What backward needs to recompute one call of a block (tensors are saved on the ctx)."""

    block_index: int
    leaves: list  # flattened (args, kwargs); tensor leaves replaced by None
    spec: TreeSpec
    tensor_positions: list[int]
    autocast: list[tuple[str, bool, torch.dtype]]
    autocast_cache: bool
    rng_states: tuple[Tensor, Tensor | None]
    train_weights: list[bool] = field(default_factory=list)  # masters' requires_grad
    weights: list[Tensor] | None = None  # set only while forward runs
    out_spec: TreeSpec | None = None
    out_leaves: list = field(default_factory=list)  # non-tensor leaves; tensors → None
    out_slots: list[int | None] = field(default_factory=list)  # leaf → unique output index


class BlockOffload:
    """Keep UNet blocks in CPU memory and stream them to ``device`` for forward and backward.

    Args:
        unet: the denoiser (a diffusers ``UNet2DConditionModel`` for SDXL), on any device.
            Its parameters keep their identity (an optimizer built before or after sees the
            same tensors).
        ordered: its blocks by name in execution order (``Backbone.blocks()``).
        device: where the UNet computes. Everything outside the offloaded blocks moves there.
            ``cpu`` is a stand-in for tests: the copies are then real copies.
        resident: how many of the candidate blocks stay on ``device`` (the largest ones,
            which have the most weights per FLOP, so their copies are the hardest to hide).
        blocks: the candidate block names (``down.0``, ``mid``, ``up.2``, ...); default all.

    ``remove()`` puts every parameter back on ``device`` and restores the plain module.
    """

    def __init__(
        self,
        unet: nn.Module,
        ordered: dict[str, nn.Module],
        device: torch.device | str,
        resident: int = 0,
        blocks: list[str] | None = None,
    ):
        self.unet = unet
        self.device = torch.device(device)
        ordered = list(ordered.items())
        names = [name for name, _ in ordered]
        candidates = names if blocks is None else list(blocks)
        unknown = [name for name in candidates if name not in names]
        if unknown:
            raise ValueError(f"offload: no block {unknown[0]!r}; this UNet has {names}")
        if not 0 <= resident <= len(candidates):
            raise ValueError(f"offload: resident must be in [0, {len(candidates)}], not {resident}")
        size = {name: _num_bytes(module) for name, module in ordered}
        by_size = sorted(candidates, key=lambda name: (-size[name], names.index(name)))
        self.resident_names = sorted(by_size[:resident], key=names.index)
        offloaded = set(by_size[resident:])
        self._pin = self.device.type == "cuda"
        self._blocks = [self._make_block(n, m) for n, m in ordered if n in offloaded]
        self._place_rest()
        self._h2d = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._d2h = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._ready: dict[int, _Loaded] = {}  # block index → weights fetched ahead of use
        self._pending: list[tuple[nn.Parameter, Tensor]] = []  # (master, host gradient)
        self._grad_events: list[torch.cuda.Event] = []
        self._flush_task = -2  # id of the backward pass whose end flushes the gradients
        # An input of every offloaded call that needs a gradient, so that its outputs do even
        # when only the block's weights train. The masters themselves are no inputs: autograd
        # would run their post-accumulate-grad hooks (fused backward) without a gradient.
        self._anchor = torch.empty(0, requires_grad=True)
        for index, block in enumerate(self._blocks):
            block.module.forward = partial(self._block_forward, index)
        self._hook = unet.register_forward_pre_hook(self._start_forward)

    @property
    def offloaded_names(self) -> list[str]:
        return [block.name for block in self._blocks]

    def traffic_per_step(self) -> tuple[int, int]:
        """Bytes moved by one forward + backward: (host → device, device → host).

        Weights go up twice (forward, recomputation) except the last block's, which stays
        on the device from its forward to its backward; trainable weights' gradients come down.
        """
        if not self._blocks:
            return 0, 0
        up = 2 * sum(block.num_bytes for block in self._blocks) - self._blocks[-1].num_bytes
        down = sum(
            p.numel() * p.element_size()
            for block in self._blocks
            for p in block.masters
            if p.requires_grad
        )
        return up, down

    def loaded_blocks(self) -> list[str]:
        """Blocks whose weights are fetched ahead of use (on the device between calls)."""
        return [self._blocks[index].name for index in sorted(self._ready)]

    def remove(self) -> None:
        """Undo the offload: plain forward, every parameter (and gradient) on ``device``."""
        self._hook.remove()
        self._discard_all()
        for block in self._blocks:
            del block.module.forward
            for master in block.masters:
                _move(master, self.device)
        self._blocks = []

    # --- setup ---

    def _make_block(self, name: str, module: nn.Module) -> _Block:
        if getattr(module, "_compiled_call_impl", None) is not None:
            raise ValueError(f"offload: block {name} is compiled; offloaded blocks run eagerly")
        if "forward" in module.__dict__:
            raise ValueError(f"offload: block {name} already has a patched forward")
        masters: list[nn.Parameter] = []
        index_of: dict[int, int] = {}
        slots = []
        for owner in module.modules():
            for attribute, param in owner._parameters.items():
                if param is None:
                    continue
                if id(param) not in index_of:
                    index_of[id(param)] = len(masters)
                    masters.append(param)
                slots.append((owner, attribute, index_of[id(param)]))
        for master in masters:
            _move(master, torch.device("cpu"), pin=self._pin)
        return _Block(name, module, masters, slots, module.forward)

    def _place_rest(self) -> None:
        inside = {id(p) for block in self._blocks for p in block.masters}
        for param in self.unet.parameters():
            if id(param) not in inside:
                _move(param, self.device)
        for owner in self.unet.modules():  # buffers are small: all stay on the device
            for key, buffer in owner._buffers.items():
                if buffer is not None:
                    owner._buffers[key] = buffer.to(self.device)

    # --- weights: fetch ahead, take, drop ---

    def _load(self, block: _Block) -> _Loaded:
        """Copy ``block``'s masters to the device (asynchronously on the side stream)."""
        if self._h2d is None:
            return _Loaded([m.detach().to(self.device, copy=True) for m in block.masters], None)
        compute = torch.cuda.current_stream(self.device)
        # Allocated on the compute stream, which frees them; the side stream first waits for
        # the compute work queued so far, which includes every reader of recycled memory.
        weights = [torch.empty_like(m, device=self.device) for m in block.masters]
        self._h2d.wait_stream(compute)
        with torch.cuda.stream(self._h2d):
            for weight, master in zip(weights, block.masters, strict=True):
                weight.copy_(master.detach(), non_blocking=True)
        return _Loaded(weights, self._h2d.record_event())

    def _take(self, index: int) -> list[Tensor]:
        loaded = self._ready.pop(index, None) or self._load(self._blocks[index])
        if loaded.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(loaded.ready)
        return loaded.weights

    def _prefetch(self, index: int | None) -> None:
        """Fetch block ``index`` ahead of use; anything else fetched earlier is dropped."""
        for other in [key for key in self._ready if key != index]:
            self._discard(self._ready.pop(other))
        if index is not None and 0 <= index < len(self._blocks) and index not in self._ready:
            self._ready[index] = self._load(self._blocks[index])

    def _discard(self, loaded: _Loaded) -> None:
        if loaded.ready is not None:  # freed memory may be reused only after its copy lands
            torch.cuda.current_stream(self.device).wait_event(loaded.ready)
            loaded.ready.synchronize()  # and the CPU may then update the master safely

    def _discard_all(self) -> None:
        for loaded in self._ready.values():
            self._discard(loaded)
        self._ready.clear()

    @torch.compiler.disable  # a whole-UNet torch.compile breaks its graph here
    def _start_forward(self, module: nn.Module, args: tuple) -> None:
        self._prefetch(0)  # overlaps the first block's copy with the time embedding and conv_in

    # --- forward ---

    @torch.compiler.disable  # offloaded blocks run eagerly (docs/offload.md, limits)
    def _block_forward(self, index: int, *args: Any, **kwargs: Any) -> Any:
        block = self._blocks[index]
        leaves, spec = tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        inputs = [leaves[i] for i in positions]
        weights = self._take(index)
        self._prefetch(index + 1)
        differentiable = torch.is_grad_enabled() and any(
            t.requires_grad for t in [*inputs, *block.masters]
        )
        if not differentiable:
            with _swapped(block, weights):
                return block.forward(*args, **kwargs)
        for i in positions:
            leaves[i] = None
        autocast, autocast_cache = _autocast_state(self.device)
        call = _Call(
            index, leaves, spec, positions, autocast, autocast_cache, _rng_states(self.device)
        )
        call.weights = weights
        call.train_weights = [master.requires_grad for master in block.masters]
        outputs = _OffloadedBlock.apply(self, call, self._anchor, *inputs)
        call.weights = None
        if index == len(self._blocks) - 1:  # backward starts with this block: keep it
            self._ready[index] = _Loaded(weights, None)
        flat = [leaf if slot is None else outputs[slot] for leaf, slot in _zip_out(call)]
        return tree_unflatten(flat, call.out_spec)

    def _run(self, call: _Call, inputs: list[Tensor]) -> list[Tensor]:
        """Run the block (weights swapped in) on ``inputs``; its unique output tensors."""
        leaves = list(call.leaves)
        for position, tensor in zip(call.tensor_positions, inputs, strict=True):
            leaves[position] = tensor
        args, kwargs = tree_unflatten(leaves, call.spec)
        out_leaves, call.out_spec = tree_flatten(
            self._blocks[call.block_index].forward(*args, **kwargs)
        )
        unique: list[Tensor] = []
        seen: dict[int, int] = {}
        call.out_leaves, call.out_slots = [], []
        for leaf in out_leaves:
            if isinstance(leaf, Tensor):
                if id(leaf) not in seen:
                    seen[id(leaf)] = len(unique)
                    unique.append(leaf)
                call.out_slots.append(seen[id(leaf)])
                call.out_leaves.append(None)
            else:
                call.out_slots.append(None)
                call.out_leaves.append(leaf)
        return unique

    # --- backward ---

    def _backward(
        self, call: _Call, inputs: tuple[Tensor, ...], grads: tuple, needs: tuple[bool, ...]
    ) -> tuple[Tensor | None, ...]:
        """Input gradients of one block call; its weight gradients go to the CPU masters."""
        block = self._blocks[call.block_index]
        task = torch._C._current_graph_task_id()
        if self._flush_task != task:  # the first offloaded block of this backward pass
            self._flush_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
        weights = self._take(call.block_index)
        self._prefetch(call.block_index - 1)
        num_inputs = len(inputs)
        needs_inputs = needs[:num_inputs]
        leaves = [x.detach().requires_grad_(n) for x, n in zip(inputs, needs_inputs, strict=True)]
        leaves += [
            w.requires_grad_(need) for w, need in zip(weights, needs[num_inputs:], strict=True)
        ]
        wrt = [leaf for leaf, need in zip(leaves, needs, strict=True) if need]
        with _swapped(block, leaves[num_inputs:]):  # diffusers' own checkpointing reads them
            with torch.enable_grad(), _autocast(call), _rng(call, self.device):
                outputs = self._run(call, leaves[:num_inputs])
            pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None]
            pairs = [(o, g) for o, g in pairs if o.requires_grad]
            found = [None] * len(wrt)
            if pairs and wrt:
                found = torch.autograd.grad(
                    [o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True
                )
        del outputs, pairs, leaves, weights, wrt
        found_iter = iter(found)
        result = [next(found_iter) if need else None for need in needs]
        self._send_grads(block, result[num_inputs:])
        return tuple(result[:num_inputs])

    def _send_grads(self, block: _Block, grads: list[Tensor | None]) -> None:
        """Copy weight gradients into fresh (pinned) host tensors; added at the end of backward."""
        if self._d2h is not None:
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h) if self._d2h is not None else contextlib.nullcontext():
            for master, grad in zip(block.masters, grads, strict=True):
                if grad is None:
                    continue
                host = torch.empty_strided(
                    master.shape, master.stride(), dtype=master.dtype, pin_memory=self._pin
                )
                host.copy_(grad, non_blocking=self._d2h is not None)
                if self._d2h is not None:
                    grad.record_stream(self._d2h)  # its memory is reused after the copy only
                self._pending.append((master, host))
        if self._d2h is not None:
            self._grad_events.append(self._d2h.record_event())

    def _flush(self) -> None:
        """End of backward: wait for the copies, then accumulate into the masters' ``.grad``."""
        for event in self._grad_events:
            event.synchronize()
        self._discard_all()
        pending, self._pending, self._grad_events = self._pending, [], []
        for master, host in pending:
            if master.grad is None:
                master.grad = host
            else:
                master.grad += host
        for master, _ in pending:  # e.g. fused backward's optimizer step, as autograd would
            for hook in (getattr(master, "_post_accumulate_grad_hooks", None) or {}).values():
                hook(master)


class _OffloadedBlock(torch.autograd.Function):
    """One offloaded block call: (anchor, *input tensors) → unique output tensors. Saves the
    inputs only; backward recomputes the block (:meth:`BlockOffload._backward`)."""

    @staticmethod
    def forward(
        ctx, offload: BlockOffload, call: _Call, anchor: Tensor, *inputs: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.offload, ctx.call = offload, call
        ctx.save_for_backward(*inputs)
        with _swapped(offload._blocks[call.block_index], call.weights):
            return tuple(offload._run(call, list(inputs)))

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        needs = (*ctx.needs_input_grad[3:], *ctx.call.train_weights)
        return (None, None, None, *ctx.offload._backward(ctx.call, ctx.saved_tensors, grads, needs))


# --- helpers ---


@contextlib.contextmanager
def _swapped(block: _Block, weights: list[Tensor]) -> Iterator[None]:
    """The block's parameters are ``weights`` inside; the CPU masters again afterwards."""
    for owner, attribute, index in block.slots:
        owner._parameters[attribute] = weights[index]
    try:
        yield
    finally:
        for owner, attribute, index in block.slots:
            owner._parameters[attribute] = block.masters[index]


def _zip_out(call: _Call) -> Iterator[tuple[Any, int | None]]:
    return zip(call.out_leaves, call.out_slots, strict=True)


def _num_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _move(param: nn.Parameter, device: torch.device, pin: bool = False) -> None:
    """Move a parameter (and its gradient) in place, keeping its identity."""
    param.data = param.data.to(device)
    if param.grad is not None:
        param.grad = param.grad.to(device)
    if pin and not param.data.is_pinned():
        param.data = param.data.pin_memory()
        if param.grad is not None:
            param.grad = param.grad.pin_memory()


def _autocast_state(device: torch.device) -> tuple[list, bool]:
    """Autocast as forward saw it, for the recomputation (backward runs on other threads)."""
    kinds = sorted({device.type, "cpu"})
    state = [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds]
    return state, torch.is_autocast_cache_enabled()


@contextlib.contextmanager
def _autocast(call: _Call) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for kind, enabled, dtype in call.autocast:
            stack.enter_context(
                torch.autocast(
                    kind, dtype=dtype, enabled=enabled, cache_enabled=call.autocast_cache
                )
            )
        yield


def _rng_states(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _rng(call: _Call, device: torch.device) -> Iterator[None]:
    """Replay forward's random numbers (dropout) in the recomputation, then restore the RNG."""
    cpu_state, cuda_state = call.rng_states
    devices = [] if cuda_state is None else [device]
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
        yield
