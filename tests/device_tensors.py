"""The CPU's stand-in for an accelerator: where a run on a GPU would hand numpy a tensor not copied to the host.

On a GPU, `tensor.numpy()` and `np.asarray(tensor)` (and so matplotlib, lifelines, scipy, PIL and nibabel, which all
go through `__array__`) raise for a tensor still on the device; on the CPU they work, so a CPU run cannot show the
mistake. Here the accelerator is played by `cpu:0` (`ACCELERATOR`) and the host by `cpu`: both are the CPU's memory,
but a tensor moved to `cpu:0` becomes a `DeviceTensor`, and that refuses numpy until `.cpu()` or `.to("cpu")` moves
it back to the host.

`accelerator(monkeypatch)` runs a block as if a GPU were there: Lightning's single-device strategy puts the model and
every batch on `ACCELERATOR` (its root device), predict.py's `device=` becomes it too, and every operation on a device
tensor gives a device tensor again: the model's outputs, the metrics' states, what the epoch-end hooks make of them,
until the code moves them. Factories asked for the device (`torch.zeros(..., device=self.device)`) make device
tensors. What it cannot play: `tensor.device` reads `cpu` for both, so `.to(x.device)` counts as a move to the host.
A device tensor saved (a checkpoint) is saved as a plain one, as a CUDA tensor saved is read back wherever
`map_location` puts it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pytorch_lightning.strategies import SingleDeviceStrategy
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

import medvol.run.predict_check

ACCELERATOR = torch.device("cpu", 0)
# What a CUDA tensor says, so that a failure reads like the one a GPU gives.
REFUSAL = "can't convert a device tensor to numpy (nor can a CUDA one): use Tensor.cpu() to copy it to the host first"


class DeviceTensor(torch.Tensor):
    """A tensor on the played accelerator: every operation on it gives a `DeviceTensor`; numpy refuses it."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.numpy or func is torch.Tensor.__array__:
            raise TypeError(REFUSAL)
        return super().__torch_function__(func, types, args, kwargs or {})

    def __reduce_ex__(self, protocol: Any) -> Any:
        return torch.Tensor.__reduce_ex__(self.as_subclass(torch.Tensor), protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> DeviceTensor:
        return copy.deepcopy(self.as_subclass(torch.Tensor), memo).as_subclass(DeviceTensor)

    def __format__(self, spec: str) -> str:
        # torch formats a 0-d tensor by its value for its own class alone; a CUDA scalar formats so too.
        return self.as_subclass(torch.Tensor).__format__(spec)


def on_device(data: Any) -> Any:
    """`data` (a tensor, or tensors in dicts, lists, tuples) with every tensor a `DeviceTensor`."""
    return tree_map_only(torch.Tensor, lambda t: t.as_subclass(DeviceTensor), data)


def on_host(data: Any) -> Any:
    """`data` with every `DeviceTensor` a plain tensor."""
    return tree_map_only(DeviceTensor, lambda t: t.as_subclass(torch.Tensor), data)


def placement(value: Any) -> bool | None:
    """True where `value` names the accelerator (the device, its name, a tensor on it), False the host, None where
    it names no device."""
    if isinstance(value, torch.Tensor):
        return isinstance(value, DeviceTensor)
    if isinstance(value, (str, torch.device)):
        try:
            device = torch.device(value)
        except RuntimeError:
            return None
        return device == ACCELERATOR
    return None


class Accelerated(TorchFunctionMode):
    """Moves to `ACCELERATOR` give device tensors, `.cpu()` and moves to the host plain ones."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func is torch.Tensor.cpu:
            return on_host(result)
        if func is torch.Tensor.to:
            targets = [placement(a) for a in (*args[1:], *kwargs.values())]
            target = next((t for t in targets if t is not None), None)
        else:
            target = placement(kwargs.get("device"))
        if target is None:
            return result
        return on_device(result) if target else on_host(result)


@contextlib.contextmanager
def accelerator(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Runs the block as on a GPU where numpy is concerned (module docstring)."""
    host_root = SingleDeviceStrategy.root_device

    def root_device(self: SingleDeviceStrategy) -> torch.device:
        device = host_root.fget(self)
        return ACCELERATOR if device.type == "cpu" else device

    with monkeypatch.context() as patch:
        patch.setattr(SingleDeviceStrategy, "root_device", property(root_device))
        patch.setattr(medvol.run.predict_check, "pick_device", lambda name: ACCELERATOR)
        with Accelerated():
            yield
