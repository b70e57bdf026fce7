"""A GPU's memory and work seen on the CPU: bf16 autocast as CUDA runs it, device memory as its allocator counts it.

The preflight (`medvol/run/preflight.py`) and `benchmarks/gpu/gpu_estimates.py` run a GPU step on fake tensors
(`FakeTensorMode`: shapes, dtypes and autograd without data) on the CPU, with or without a CUDA device. Three pieces
make that a GPU's step:

- `cuda_autocast_policy()`: CPU autocast (`torch.autocast("cpu", dtype=torch.bfloat16)`) with CUDA's op lists. CUDA
  runs GroupNorm, softmax, the upsampling ops and the losses in float32 and convolutions, matrix products and
  attention in bf16; CPU autocast keeps GroupNorm and softmax in bf16 and runs 3D pooling in float32. The lists are
  read from the installed torch's own `ATen/autocast_mode.h` (the macros CUDA's autocast is built from), and each
  op's CPU autocast kernel is replaced by one that applies CUDA's policy (ops CUDA does not autocast run as they
  are). Being autocast kernels, they run before autograd records the casts, and `torch.utils.checkpoint`
  re-enters them when it recomputes, as on the GPU.
- `DeviceMemory`: every tensor storage alive, in the 512-byte blocks of PyTorch's CUDA caching allocator: the
  current and peak bytes (what `torch.cuda.max_memory_allocated` reports) and the largest single allocation.
  Kernel workspaces (cuDNN's) are not tensors and are not counted.
- `StepFlops`: the FLOPs of `torch.utils.flop_counter.FlopCounterMode`'s formulas, the CPU's fused attention counted
  as the GPU's.
"""

from __future__ import annotations

import re
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop, sdpa_flop
from torch.utils.weak import WeakIdKeyDictionary

from medvol.core.errors import MedvolError

AUTOCAST_HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
# The policy of each list macro of the header (CUDA registers every op of these lists with that policy).
POLICY_LISTS = {
    "AT_FORALL_LOWER_PRECISION_FP": "lower_precision_fp",
    "AT_FORALL_FP32": "fp32",
    "AT_FORALL_FP32_SET_OPT_DTYPE": "fp32_set_opt_dtype",
    "AT_FORALL_PROMOTE": "promote",
}
# The caching allocator's smallest block: every allocation is rounded up to a multiple of it.
BLOCK = 512
AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def cuda_policies(header: Path = AUTOCAST_HEADER) -> dict[str, str]:
    """`aten::op[.overload]` -> CUDA autocast's policy for it, from the installed torch's header."""
    if not header.is_file():
        raise MedvolError(f"{header} is missing: the estimate reads CUDA's autocast op lists from torch's headers")
    text = header.read_text()
    policies: dict[str, str] = {}
    for macro, policy in POLICY_LISTS.items():
        found = re.search(rf"#define {macro}\(_\)(.*?)\n\s*\n", text, re.S)
        if found is None:
            raise MedvolError(f"{header} has no {macro}: this torch's autocast lists are not where the estimate reads")
        for name, overload in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", found.group(1)):
            policies[f"aten::{name}" + (f".{overload}" if overload else "")] = policy
    # norm's overloads without a dtype are redispatched to the ones with one, in float32 (`fp32_append_dtype`).
    for name in re.findall(r'"(norm\.\w+)"', text):
        policies[f"aten::{name}"] = "fp32_append_dtype"
    return policies


def _overload(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _eligible(value: Any) -> bool:
    """What autocast casts: floating-point tensors other than float64."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _cast(dtype: torch.dtype, values: Any) -> Any:
    return tree_map(lambda v: v.to(dtype) if _eligible(v) and v.dtype != dtype else v, values)


def _kernel(name: str, policy: str, lower: torch.dtype) -> Callable[..., Any]:
    """A CPU autocast kernel for op `name` that applies CUDA's `policy` (None: runs the op as it is)."""
    op = _overload(name)
    arguments = [a.name for a in op._schema.arguments]

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(AUTOCAST_CPU):
            first = next((v for v in tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)), None)
            if policy == "lower_precision_fp":
                return op(*_cast(lower, args), **_cast(lower, kwargs))
            if policy == "fp32":
                return op(*_cast(torch.float32, args), **_cast(torch.float32, kwargs))
            if policy == "fp32_set_opt_dtype" and _eligible(first):
                index = arguments.index("dtype")
                if len(args) > index:
                    args = (*args[:index], args[index] or torch.float32, *args[index + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            if policy == "fp32_append_dtype" and _eligible(first):
                with_dtype = getattr(torch.ops.aten.norm, f"{op._overloadname}_dtype")
                return with_dtype(*args, **kwargs, dtype=torch.float32)
            if policy == "promote":
                dtypes = [v.dtype for v in tree_leaves((args, kwargs)) if _eligible(v)]
                widest = torch.float32 if torch.float32 in dtypes else lower
                return op(*_cast(widest, args), **_cast(widest, kwargs))
            return op(*args, **kwargs)

    return kernel


@contextmanager
def cuda_autocast_policy(lower: torch.dtype = torch.bfloat16) -> Iterator[dict[str, str]]:
    """Within: CPU autocast follows CUDA's op lists (the policies, by op). Ops with a CPU autocast kernel that CUDA
    does not autocast (3D pooling, padding, `cat`) run as they are, as on the GPU."""
    policies = cuda_policies()
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            # Each replaced kernel is announced ("Overriding a previously registered kernel"): that is the point.
            warnings.simplefilter("ignore", UserWarning)
            for name in torch._C._dispatch_get_all_op_names():
                if not name.startswith("aten::"):
                    continue
                policy = policies.get(name)
                cpu, cuda = has(name, "AutocastCPU"), has(name, "AutocastCUDA")
                # CUDA's lower-precision ops that CPU autocast also runs in lower precision keep CPU's kernel (and
                # its cache of the cast weights, as CUDA's).
                if (policy == "lower_precision_fp" and cpu) or (policy is None and (not cpu or cuda)):
                    continue
                library.impl(name.removeprefix("aten::"), _kernel(name, policy, lower), "AutocastCPU",
                             with_keyset=True)
        yield policies
    finally:
        library._destroy()


@contextmanager
def gpu_autocast(lower: torch.dtype = torch.bfloat16) -> Iterator[None]:
    """The region a GPU step runs under `torch.autocast("cuda", lower)`, for CPU (fake) tensors; within
    `cuda_autocast_policy`."""
    with torch.autocast("cpu", dtype=lower):
        yield


class DeviceMemory(TorchDispatchMode):
    """The bytes of every tensor storage alive while it is active (and of those handed to `track`), counted as the
    CUDA caching allocator counts them: `current`, `peak` and the `largest` single allocation."""

    def __init__(self) -> None:
        super().__init__()
        self.live: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.current = self.peak = self.largest = 0

    def track(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage in self.live:
                continue
            size = -(-storage.nbytes() // BLOCK) * BLOCK
            self.live[storage] = size
            weakref.finalize(storage, self._free, size)
            self.current += size
            self.largest = max(self.largest, size)
            self.peak = max(self.peak, self.current)

    def _free(self, size: int) -> None:
        self.current -= size

    def reset_peak(self) -> None:
        """As `torch.cuda.reset_peak_memory_stats`: the peak from now on starts at what is allocated."""
        self.peak = self.current

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.track(*(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)))
        return out


class StepFlops(TorchDispatchMode):
    """The FLOPs of the matrix products, convolutions and attention run while active (`total`), by the formulas of
    torch's `FlopCounterMode`, with the CPU's fused attention counted as the GPU's. FlopCounterMode's own module
    tracking is left out: it refuses `torch.autograd.grad`, which the VQ-GAN's step calls."""

    def __init__(self) -> None:
        super().__init__()
        aten = torch.ops.aten
        # The registered formulas are wrapped to take tensors; a custom mapping takes them as written (on shapes).
        self.formulas = FlopCounterMode(display=False, custom_mapping={
            aten._scaled_dot_product_flash_attention_for_cpu: sdpa_flop.__wrapped__,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_backward_flop.__wrapped__,
        }).flop_registry
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


def as_fake(module: torch.nn.Module, mode: FakeTensorMode) -> torch.nn.Module:
    """`module` with every parameter and buffer replaced in place by a fake tensor of `mode` (shared ones stay
    shared; 0-d buffers keep their value, so code that reads a scalar buffer still can)."""
    fakes: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in fakes:
            if tensor.dim():
                fakes[id(tensor)] = mode.from_tensor(tensor.detach())
            else:
                value = tensor.item()
                with mode:
                    fakes[id(tensor)] = torch.tensor(value, dtype=tensor.dtype)
        return fakes[id(tensor)]

    for part in module.modules():
        for name, parameter in part._parameters.items():
            if parameter is not None:
                part._parameters[name] = torch.nn.Parameter(fake(parameter), parameter.requires_grad)
        for name, buffer in part._buffers.items():
            if buffer is not None:
                part._buffers[name] = fake(buffer)
    return module


class HostIntegers(TorchFunctionMode):
    """Small integer tensors made from Python numbers and read back as numbers (MONAI's Dice loss lists its reduced
    axes with `torch.arange(...).tolist()`) stay real tensors, read outside the fake mode: a fake tensor has no
    values to read."""

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "arange" and not kwargs and all(type(a) is int for a in args):
            with unset_fake_temporarily():
                return func(*args)
        if name in ("tolist", "item") and args and type(args[0]) is torch.Tensor:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def measured_step(step: Callable[[], Any], tensors: Sequence[torch.Tensor], mode: FakeTensorMode) -> tuple[
        DeviceMemory, StepFlops]:
    """A fake training step measured as a GPU runs it: the device memory over two steps (the second with the
    optimizer's state) on top of `tensors` (weights, buffers, inputs: what is allocated before the peak is reset),
    and the second step's FLOPs (counted in the same pass: a step's ops are the same every step, and a third step
    would add half again to the preflight's time)."""
    memory = DeviceMemory()
    memory.track(*tensors)
    memory.reset_peak()
    flops = StepFlops()
    with mode, HostIntegers(), memory:
        step()
        with flops:
            step()
    return memory, flops
