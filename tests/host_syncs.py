"""Host syncs counted on the CPU: the operations that would make the host wait for a GPU.

A CPU tensor never makes the host wait, so a CPU run cannot show a sync; here the GPU is played as
tests/device_tensors.py plays it (`accelerator`: the model, its buffers and every batch are `DeviceTensor`s, and so
is everything computed from them), and `HostSyncs` records each operation that, on a CUDA device, either reads a
device tensor's values on the host or copies host memory to the device without `non_blocking` (what
`torch.cuda.set_sync_debug_mode` warns about):

- a value read: `.item()`, `bool`/`int`/`float`/`index` of a tensor (`if tensor:`, `range(tensor)`), `.tolist()`,
  `.numpy()`, `.cpu()`, `torch.equal`/`allclose` of a device tensor (`aten._local_scalar_dense` at the dispatcher,
  so a read inside a library counts too);
- a shape that depends on values: `nonzero`, `masked_select`, `unique`, `bincount` (CUDA reads the extremes),
  `repeat_interleave` without `output_size`, and indexing or assigning through a boolean mask;
- a host-to-device copy without `non_blocking`: `torch.tensor(..., device=...)`, `.to(device)` or `.copy_` of a host
  tensor into a device one, and a host index tensor used on a device tensor (CUDA copies it first).

Host tensors that a GPU run keeps on the host too (an optimizer's step counters, a CPU generator's draws) are plain
tensors here and their reads count nothing. What it cannot see: `tensor.device` reads `cpu` for both, so a copy to
`x.device` counts only when it moves a host tensor (never a device tensor's `.to(x.device)`, a no-op on a GPU).
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.device_tensors import DeviceTensor
from tests.device_tensors import on_device as on_device_tensors

ROOT = Path(__file__).resolve().parents[1]
Tensor = torch.Tensor
# Reads of a device tensor's values that go no further than Python (no aten op on a CPU tensor).
READS = {
    Tensor.tolist: "tolist", Tensor.numpy: "numpy", Tensor.cpu: "cpu", Tensor.__array__: "numpy",
    torch.equal: "equal", Tensor.equal: "equal", torch.allclose: "allclose", Tensor.allclose: "allclose",
}
# Copies of host data to the device.
FACTORIES = {torch.tensor: "torch.tensor", torch.as_tensor: "torch.as_tensor", torch.asarray: "torch.asarray",
             Tensor.new_tensor: "new_tensor"}
aten = torch.ops.aten
# Ops whose output shape depends on the values: CUDA reads a count back before it can allocate.
DATA_DEPENDENT = {
    aten.nonzero.default: "nonzero", aten.masked_select.default: "masked_select", aten._unique2.default: "unique",
    aten.unique_dim.default: "unique", aten.unique_consecutive.default: "unique_consecutive",
    aten.bincount.default: "bincount", aten.repeat_interleave.Tensor: "repeat_interleave",
    aten.repeat_interleave.self_Tensor: "repeat_interleave",
}
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
INDEX_ARGUMENTS = {aten.index_select.default: 2, aten.gather.default: 2, aten.scatter.src: 2, aten.scatter_.src: 2,
                   aten.scatter_add.default: 2, aten.scatter_add_.default: 2, aten.index_add.default: 2,
                   aten.index_add_.default: 2, aten.embedding.default: 1}


def on_device(value: Any) -> bool:
    """Whether `value` is a tensor a GPU run keeps on the GPU (a played device tensor or a parameter)."""
    return isinstance(value, (DeviceTensor, nn.Parameter))


def on_host(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not on_device(value)


def names_the_device(value: Any) -> bool:
    """Whether `value`, given as a device, means the GPU: a `torch.device` (in a step, `x.device`, which reads `cpu`
    here) or a device tensor to follow; a device's name (`"cpu"`) means the host, as torch.optim's step counters
    ask for it."""
    if isinstance(value, str):
        return torch.device(value) != torch.device("cpu")
    return isinstance(value, torch.device) or on_device(value)


def targets_the_device(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call makes or moves a tensor onto the GPU (`device=`, or `.to(device)`, `.to(tensor)`)."""
    if func is Tensor.to:
        return any(names_the_device(a) for a in (*args[1:], kwargs.get("device"), kwargs.get("other")))
    return names_the_device(kwargs.get("device"))


@dataclass(frozen=True)
class Sync:
    kind: str
    where: str

    def __str__(self) -> str:
        return f"{self.kind} at {self.where}"


def caller() -> str:
    """The innermost frame in this repository outside tests/ (else the innermost outside torch), as `path:line`."""
    frames = traceback.extract_stack()[:-3]
    for frame in reversed(frames):
        path = Path(frame.filename)
        if path.is_relative_to(ROOT) and ".venv" not in path.parts and "tests" not in path.relative_to(ROOT).parts:
            return f"{path.relative_to(ROOT)}:{frame.lineno} ({frame.name})"
    for frame in reversed(frames):
        if "/torch/" not in frame.filename and "tests/host_syncs.py" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "?"


class _Reads(TorchFunctionMode):
    def __init__(self, record: HostSyncs) -> None:
        super().__init__()
        self.record = record

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not self.record.counting:
            return result
        self.record.function_call(func, args, kwargs)
        # What a step makes or moves on `x.device` is on the GPU, though `x.device` reads `cpu` here.
        return on_device_tensors(result) if targets_the_device(func, args, kwargs) else result


class _Ops(TorchDispatchMode):
    def __init__(self, record: HostSyncs) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.record.counting:
            self.record.dispatched(func, args, kwargs)
        return func(*args, **kwargs)


class HostSyncs:
    """Records the host syncs of the code run inside it (module docstring), each with the repository line that
    asked for it; `paused()` leaves a block out (Lightning's own logging, which syncs at its own times)."""

    def __init__(self) -> None:
        self.syncs: list[Sync] = []
        self.counting = True
        self._modes = (_Reads(self), _Ops(self))

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def add(self, kind: str) -> None:
        self.syncs.append(Sync(kind, caller()))

    def function_call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if func in READS and any(on_device(a) for a in args[:2]):
            self.add(READS[func])
        elif func in FACTORIES and targets_the_device(func, args, kwargs) and not on_device(args[0] if args else None):
            self.add(f"{FACTORIES[func]}(..., device=) copies host data to the device")
        elif func is Tensor.to and on_host(args[0]) and targets_the_device(func, args, kwargs) \
                and not kwargs.get("non_blocking") and not any(a is True for a in args[2:]):
            self.add("host tensor .to(device) without non_blocking")
        elif func is Tensor.copy_ and on_device(args[0]) and on_host(args[1]) and not kwargs.get("non_blocking"):
            self.add("copy_ of a host tensor into a device tensor")

    def dispatched(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if not any(on_device(t) for t in tensors):
            return
        if func is aten._local_scalar_dense.default:
            self.add("value read (.item(), bool(), int(), float(), an index)")
        elif func in DATA_DEPENDENT and not (func.__name__.startswith("repeat_interleave") and kwargs.get(
                "output_size") is not None):
            self.add(DATA_DEPENDENT[func])
        elif func in INDEXING:
            indices = [i for i in tree_leaves(args[1]) if isinstance(i, torch.Tensor)]
            if any(i.dtype in (torch.bool, torch.uint8) for i in indices):
                self.add("boolean-mask indexing")
            elif on_device(args[0]) and any(on_host(i) and i.dim() > 0 for i in indices):
                self.add("host index tensor used on a device tensor")
        elif func in INDEX_ARGUMENTS:
            index = args[INDEX_ARGUMENTS[func]] if len(args) > INDEX_ARGUMENTS[func] else None
            if on_host(index) and index.dim() > 0 and any(on_device(a) for a in args[:1]):
                self.add("host index tensor used on a device tensor")

    def paused(self) -> _Paused:
        return _Paused(self)

    def counts(self) -> Counter[str]:
        return Counter(str(s) for s in self.syncs)


class _Paused:
    def __init__(self, record: HostSyncs) -> None:
        self.record, self.before = record, record.counting

    def __enter__(self) -> None:
        self.before, self.record.counting = self.record.counting, False

    def __exit__(self, *exc: Any) -> None:
        self.record.counting = self.before
