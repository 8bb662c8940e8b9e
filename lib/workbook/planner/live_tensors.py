"""Bytes of live tensor storage over a run of PyTorch code, by kind and by phase: the tracker behind
``planner.trace``.

Every op's outputs pass through a ``TorchDispatchMode``; each new storage is counted until a weak
reference to it reports it freed, so the running total is what an allocator would hold (before its
rounding to blocks). It works the same on real tensors and on fake ones (``FakeTensorMode``: shapes,
no data), which is what lets a trace on fake tensors be checked against the same step on real
tensors to the byte (tests/test_trace.py). torch's own ``torch.distributed._tools.mem_tracker``
(what torchtitan's estimator uses) does this too, but lives in a private module that changes
between the releases the workbook supports (2.11 on the GPU image, 2.13 here); this one is ~150
lines on public hooks.

Kinds: ``parameters`` (and buffers), ``gradients`` (a parameter's ``.grad`` once accumulated),
``optimizer_states``, ``activations`` (created in forward and still alive: what autograd keeps for
backward, and the logits), ``autocast_weight_copies`` (an autocast cast of a parameter, kept for
backward), ``kv_cache`` (tensors a generation cache holds), ``inputs`` (a batch's token ids) and
``temporaries`` (everything else: made in backward, the optimizer step or a decode step).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

KINDS = ("parameters", "gradients", "optimizer_states", "activations", "autocast_weight_copies", "kv_cache",
         "inputs", "temporaries")


@dataclass
class Peak:
    """The most bytes alive at once, when (the phase) and what they were, by kind."""

    bytes: int = 0
    phase: str = ""
    by_kind: dict[str, int] = field(default_factory=dict)


class _Storage:
    __slots__ = ("bytes", "kind", "reference")

    def __init__(self, nbytes: int, kind: str, reference):
        self.bytes, self.kind, self.reference = nbytes, kind, reference


class LiveTensors(TorchDispatchMode):
    """Counts live storage bytes, by kind, as ops run under it; ``peak`` is the largest total seen.

    Push it inside a ``FakeTensorMode`` (``with fake_mode, tracker:``) to trace fake tensors: ops whose
    tensor inputs are all real (a batch's position ids read as numbers, say) then run for real, as the
    workbook's code needs their values, and the rest on fake tensors (``real_when_no_fake_input``).
    """

    def __init__(self, real_when_no_fake_input: bool = False):
        super().__init__()
        self.real_when_no_fake_input = real_when_no_fake_input
        self.phase = "setup"
        self.recording = True  # False: ops are counted but no peak is noted (work that stands in for other work)
        self.creation_kind = "temporaries"  # the kind of what ops make now: 'activations' in forward
        self.by_kind = dict.fromkeys(KINDS, 0)
        self.total = 0
        self.peak = Peak()
        self.phase_peaks: dict[str, int] = {}
        self._storages: dict[int, _Storage] = {}  # id(untyped storage) -> its record
        self._parameter_storages: set[int] = set()

    # -- what is alive ------------------------------------------------------------------------

    def track(self, tensor: torch.Tensor, kind: str) -> None:
        """Count ``tensor``'s storage as ``kind`` (registering it if no op made it under the tracker)."""
        storage = tensor.untyped_storage()
        key = id(storage)
        record = self._storages.get(key)
        if record is None:
            self._add(storage, kind)
        elif record.kind != kind:
            self.by_kind[record.kind] -= record.bytes
            self.by_kind[kind] += record.bytes
            record.kind = kind
        if kind == "parameters":
            self._parameter_storages.add(key)

    def track_module(self, module: torch.nn.Module) -> None:
        """Every parameter and buffer of ``module`` as ``parameters`` (tied ones once)."""
        for tensor in [*module.parameters(), *module.buffers()]:
            self.track(tensor, "parameters")

    def track_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's state tensors (AdamW's moments and step counts) as ``optimizer_states``."""
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.track(value, "optimizer_states")

    def track_gradients(self, module: torch.nn.Module) -> list:
        """Count each parameter's gradient as ``gradients`` once autograd has accumulated it; returns
        the hook handles (``remove()`` each when done)."""
        def accumulated(parameter):
            if parameter.grad is not None:
                self.track(parameter.grad, "gradients")
        return [parameter.register_post_accumulate_grad_hook(accumulated)
                for parameter in module.parameters() if parameter.requires_grad]

    def set_phase(self, phase: str, creation_kind: str = "temporaries") -> None:
        self.phase, self.creation_kind = phase, creation_kind

    def reset_peak(self) -> None:
        """Forget the peak so far (e.g. after a first step whose optimizer states did not exist yet)."""
        self.peak = Peak(self.total, self.phase, dict(self.by_kind))
        self.phase_peaks = {}

    def _add(self, storage, kind: str) -> None:
        key = id(storage)
        nbytes = storage.nbytes()
        reference = weakref.ref(storage, lambda _, key=key: self._freed(key))
        self._storages[key] = _Storage(nbytes, kind, reference)
        self.by_kind[kind] += nbytes
        self.total += nbytes

    def _freed(self, key: int) -> None:
        record = self._storages.pop(key, None)
        if record is not None:
            self.by_kind[record.kind] -= record.bytes
            self.total -= record.bytes
            self._parameter_storages.discard(key)

    def _note_peak(self) -> None:
        if not self.recording:
            return
        if self.total > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.total
        if self.total > self.peak.bytes:
            self.peak = Peak(self.total, self.phase, dict(self.by_kind))

    # -- the ops ------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if self.real_when_no_fake_input and tensors and not any(_is_fake(t) for t in tensors):
            with _disable_current_modes():
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        kind = self.creation_kind
        # autocast's cast of a weight: kept for backward while forward runs (the plan's own term)
        if (kind == "activations" and func is torch.ops.aten._to_copy.default and tensors
                and id(tensors[0].untyped_storage()) in self._parameter_storages):
            kind = "autocast_weight_copies"
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                if id(storage) not in self._storages:  # a view or an in-place op shares its input's storage
                    self._add(storage, kind)
        self._note_peak()
        return out


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(tensor, FakeTensor)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[id(storage)] = storage.nbytes()
    return sum(seen.values())
