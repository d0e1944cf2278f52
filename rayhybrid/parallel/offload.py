"""`train.offload_activations`: what autograd saves for backward inside a transformer block is
copied to host memory in forward and brought back for backward, block by block.

    offload = offload_blocks(blocks)   # after activation checkpointing and compile, before dp

Each block's forward runs under torch's `saved_tensors_hooks` (a forward pre-hook enters them,
a forward hook leaves them): the pack hook copies a saved activation to host memory and hands
autograd the host copy; the unpack hook gives autograd the tensor back on the block's device.
What is not an activation stays where it is: parameters and their views (and bfloat16
autocast's cached copies of them), tensors already in host memory, tensors under `MIN_BYTES`,
tensor subclasses other than DTensor (float8's scaled tensors stay on the device).
A DTensor (tensor parallelism) moves its local tensor and is rebuilt around it on the way back.
With activation checkpointing the hooks see only what the checkpoint keeps, the block's input
(torch's non-reentrant checkpoint saves it outside its own hooks); the recomputation in backward
runs under the checkpoint's hooks, not these.

On CUDA the copies overlap compute: a copy to (pinned) host memory runs on a side stream once
the producing kernels are done (the side stream waits for the compute stream), and the device
tensor is handed to the allocator's stream bookkeeping (`record_stream`) so that its memory is
reused only after the copy; in backward, the first tensor a block unpacks starts copying the
previous block's tensors back on the side stream (that block's backward runs next), and an
unpacked tensor makes the compute stream wait for its copy's event. On a CPU device the host is
the device: the same path runs synchronously (a copy into a new host tensor in forward, the
host tensor itself in backward), so losses are bit for bit those without offload.

Several saved views of one storage (the input that q, k and v read, ...) send it once: the
pack hook copies whole storages (what the saved tensors keep alive) and the unpack hook makes
each view again over the storage brought back, which it lets go of once every saved view has
been unpacked (what autograd's consumers hold keeps the memory as long as they need it): a
zero-bubble schedule's weight pass, which unpacks again after the input pass, fetches again
(on CUDA a second copy) rather than the device keeping the copy in between.
`BlockOffload.moved` counts the bytes each block sent to the host (tests compare them with the
planner's count), `returned` what came back.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

MIN_BYTES = 1024
"""Smaller saved tensors stay on the device (torchtune's offloading skips them too): the copy
would cost more than it frees."""


WEIGHT_PATH = frozenset(
    {"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "AliasBackward0"}
)
"""The autograd nodes between a parameter and what a linear saves of it: autocast's cast,
the transpose or view the matmul reads."""


def _weight_like(t: torch.Tensor) -> bool:
    """A parameter, a view of one, or autocast's cast copy of one (a view of that included):
    its autograd history leads, through casts and views only, to a parameter."""
    if isinstance(t, nn.Parameter):
        return True
    fn = t.grad_fn
    for _ in range(4):
        if fn is None:
            return False
        if type(fn).__name__ == "AccumulateGrad":
            return isinstance(fn.variable, nn.Parameter)
        inputs = [nxt for nxt, _ in fn.next_functions if nxt is not None]
        if type(fn).__name__ not in WEIGHT_PATH or len(inputs) != 1:
            return False
        fn = inputs[0]
    return False


def _local(t: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
    """A DTensor's local tensor and what rebuilds it; a collective's lazily waited result
    (`AsyncCollectiveTensor`, e.g. tp's embedding all-reduce read by the first block) as the
    plain tensor it wraps, waited for; any other tensor as it is."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local(), (t.device_mesh, t.placements, t.shape, t.stride())
    if isinstance(t, AsyncCollectiveTensor):
        return t.wait(), None
    return t, None


@dataclass(eq=False)
class _Block:
    """One forward of one block: the storages it sent to the host (weakly: autograd owns them
    through the packed tensors), the device tensors it saved (kept until its forward ends, so
    that a freed one's address is not taken for a saved one's), and the block whose forward ran
    just before it in the same pass (its backward runs next)."""

    index: int
    previous: weakref.ref | None = None
    stored: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)
    originals: list = field(default_factory=list)
    fetched: bool = False


@dataclass(eq=False)
class _Storage:
    """One device storage's bytes in host memory (several saved views of it share one copy)."""

    host: torch.Tensor  # uint8
    device: torch.device
    block: _Block
    copied: torch.cuda.Event | None = None  # the copy to the host is done
    back: torch.Tensor | None = None  # on the device again, until each saved view has been unpacked
    arrived: torch.cuda.Event | None = None
    views: int = 0  # the saved views of it (packed)
    unpacked: int = 0  # their unpacks so far


@dataclass(eq=False)
class _Packed:
    storage: _Storage
    dtype: torch.dtype
    view: tuple  # storage offset, size, stride
    rebuild: tuple | None


def _bytes_of(local: torch.Tensor) -> torch.Tensor:
    """The whole storage under `local`, as uint8."""
    return torch.empty(0, dtype=torch.uint8, device=local.device).set_(local.untyped_storage())


class BlockOffload:
    """The hooks of one stage's blocks (one side stream, one set of counters)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        param = next((p for b in blocks for p in b.parameters()), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.moved = [0] * len(blocks)  # bytes each block sent to the host
        self.returned = [0] * len(blocks)  # bytes brought back
        self._open: list = []  # the hooks' contexts of the blocks now in forward
        self._last: _Block | None = None
        self._current: _Block | None = None
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(self._enter(i))
            block.register_forward_hook(self._leave, always_call=True)

    def _enter(self, index: int):
        def hook(module, args):
            if not torch.is_grad_enabled():
                self._open.append(None)
                return
            last = self._last
            self._current = _Block(index, previous=weakref.ref(last) if last and last.index == index - 1 else None)
            ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            ctx.__enter__()
            self._open.append(ctx)

        return hook

    def _leave(self, module, args, output) -> None:
        ctx = self._open.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)
            self._current.originals.clear()
            self._last, self._current = self._current, None

    def pack(self, t: torch.Tensor):
        local, rebuild = _local(t)
        block = self._current
        if (
            block is None
            or type(local) is not torch.Tensor  # another tensor subclass (float8's): its own layout
            or (local.device.type == "cpu" and self.cuda)
            or local.numel() * local.element_size() < MIN_BYTES
            or _weight_like(t)
        ):
            return t
        key = local.untyped_storage().data_ptr()
        storage = block.stored.get(key)
        if storage is None:
            storage = block.stored[key] = self._to_host(local, block)
        block.originals.append(local)
        storage.views += 1
        return _Packed(storage, local.dtype, (local.storage_offset(), local.size(), local.stride()), rebuild)

    def _to_host(self, local: torch.Tensor, block: _Block) -> _Storage:
        """Copy the storage under `local` to host memory (side stream on CUDA)."""
        data = _bytes_of(local)
        host = torch.empty_like(data, device="cpu", pin_memory=self.cuda)
        storage = _Storage(host, local.device, block)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(data, non_blocking=True)
                storage.copied = self.stream.record_event()
            data.record_stream(self.stream)
        else:
            host.copy_(data)
        self.moved[block.index] += host.numel()
        return storage

    def _fetch(self, storage: _Storage) -> None:
        """Start the copy of `storage` back to its device (side stream on CUDA)."""
        if storage.back is not None:
            return
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(storage.copied)
                storage.back = storage.host.to(storage.device, non_blocking=True)
                storage.arrived = self.stream.record_event()
        else:
            storage.back = storage.host.to(storage.device)  # the host is the device: no copy
        self.returned[storage.block.index] += storage.host.numel()

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        storage = packed.storage
        block = storage.block
        if not block.fetched:  # this block's backward begins: bring the next one's back too
            block.fetched = True
            previous = block.previous() if block.previous is not None else None
            for other in list(previous.stored.values()) if previous is not None else []:
                self._fetch(other)
        self._fetch(storage)
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(storage.arrived)
            storage.back.record_stream(current)
        offset, size, stride = packed.view
        out = torch.empty(0, dtype=packed.dtype, device=storage.device)
        out.set_(storage.back.untyped_storage(), offset, size, stride)
        storage.unpacked += 1
        if storage.unpacked % storage.views == 0:
            # Each saved view has its tensor (autograd's consumers keep its memory alive as long
            # as they need it): let go of the copy brought back. A zero-bubble schedule's weight
            # pass unpacks again, after its input pass: it fetches again rather than keeping the
            # device copy in between.
            storage.back = None
        if packed.rebuild is None:
            return out
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = packed.rebuild
        with torch.no_grad():
            return DTensor.from_local(out, mesh, placements, run_check=False, shape=shape, stride=stride)


def offload_blocks(blocks: list[nn.Module]) -> BlockOffload | None:
    """Offload what `blocks` save for backward (see the module's docstring); the offloader is
    kept on the first block as `activation_offload` (tests read its counters)."""
    if not blocks:
        return None
    offload = BlockOffload(blocks)
    blocks[0].activation_offload = offload
    return offload
