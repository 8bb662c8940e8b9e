"""Activation offloading (``offload_activations``): what autograd saves for backward moves to host
memory during forward and comes back to the device in backward, one saved tensor at a time.

``torch.autograd.graph.save_on_cpu`` copies every saved tensor, parameters included (a copy of the
weights each step) and every view separately. This keeps parameters where they are and copies each
other storage once (views are rebuilt from it), so the host holds exactly the bytes the planner
counts as activations, and the device keeps only what the running backward node unpacks. Under
autocast, the bf16 casts of the weights that matmuls save are not copied either: backward casts the
parameter again (a cast on the GPU is far cheaper than a round trip over PCIe, and the parameter has
not changed between a micro-batch's forward and its backward). As torchtune's OffloadActivations,
minus its stream overlap: the copies are synchronous here, so a step waits on PCIe (the throughput
cost); pinned host memory makes them fast.
"""

from __future__ import annotations

import weakref

import torch


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """``with OffloadActivations(model):`` around the forward (and loss) of a training step.

    ``offload_device_type``: tensors on this device type move to the host ('cuda'; the tests use
    'cpu' to run the same copies on a machine without a GPU)."""

    def __init__(self, model: torch.nn.Module, offload_device_type: str = "cuda"):
        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        pin = torch.cuda.is_available() and offload_device_type == "cuda"
        self.host_bytes = 0
        host: dict[int, tuple] = {}  # device storage -> (a live tensor on it, its bytes on the host)

        def pack(tensor: torch.Tensor):
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if tensor.device.type != offload_device_type or key in parameters or tensor.layout != torch.strided:
                return tensor
            base = tensor if tensor._base is None else tensor._base
            parameter = _cast_parameter(base, trainable)
            if parameter is not None and tensor.dtype == base.dtype:
                return ("recast", parameter, tensor.dtype, tensor.storage_offset(), tensor.size(), tensor.stride())
            first, copy = host.get(key, (lambda: None, None))
            if first() is None:  # a new storage (a freed one's address may be reused: checked by liveness)
                on_device = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
                copy = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                copy.copy_(on_device)
                # Views keep their base alive: the base's liveness is the storage's.
                host[key] = (weakref.ref(base), copy)
                self.host_bytes += storage.nbytes()
            return (tensor.device, copy, tensor.dtype, tensor.storage_offset(), tensor.size(), tensor.stride())

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            source, dtype, offset, size, stride = packed[1:]
            if packed[0] == "recast":
                with torch.no_grad():
                    on_device = source.to(dtype, copy=True)
            else:
                on_device = source.to(packed[0], non_blocking=pin, copy=True)
            return torch.empty(0, dtype=dtype, device=on_device.device).set_(
                on_device.untyped_storage(), offset, size, stride)

        super().__init__(pack, unpack)


def _cast_parameter(base: torch.Tensor, trainable: set[int]) -> torch.nn.Parameter | None:
    """The trainable parameter ``base`` is a whole cast of (autocast's weight cast), or None."""
    cast = base.grad_fn
    if cast is None or type(cast).__name__ != "ToCopyBackward0" or not base.is_contiguous():
        return None
    parameter = getattr(cast.next_functions[0][0], "variable", None)
    if parameter is None or id(parameter) not in trainable or parameter.shape != base.shape:
        return None
    return parameter


def release_pinned_host_memory() -> None:
    """Give the host back the pinned blocks torch caches after offloading (tens of GB at an 8B-shaped
    micro-batch): ``torch.cuda.empty_cache`` frees device memory only, and a notebook or a sweep goes
    on in the same process."""
    if not torch.cuda.is_available():
        return
    empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()
