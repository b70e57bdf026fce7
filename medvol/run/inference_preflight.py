"""Know before you predict: the windows a network call takes, sized from its predicted peak, not guessed.

predict.py runs a trained network window by window: the sliding window of segmentation and the VQ-GAN
(`sw_batch_size`), the diffusion walk's sampling windows (`sampling_window_batch_size`: Fast-DDPM and the LDM with a
`sampling_window`, every stage of the X-ray-to-CT whole CT). Before a subject is read, one network call on fake
tensors (`FakeTensorMode`: shapes and dtypes, no data; nothing of the windows' size is allocated) is measured as the
CUDA caching allocator counts it (`medvol.core.cuda_emulation.DeviceMemory`): the module's weights (all of them are on
the device), the windows in and every activation of the forward, without gradients, in predict.py's `precision`
(bf16 autocast as CUDA runs it, `medvol.core.cuda_emulation.cuda_autocast_policy`, or float32). `auto` takes the
largest batch (at most `settings_bounds.MAX_WINDOW_BATCH`) whose peak plus the training preflight's margin fits the
card's free memory; an integer is held against it and refused in one line, naming the largest that fits, when it
does not. One log line gives the batch, the peak and the memory.

The card: the free memory of the GPU predict.py runs on (`torch.cuda.mem_get_info`, plus what this process's
allocator already holds: the model's weights, which the prediction counts), or the card `preflight=H100` names (or a
size, `preflight=24GiB`): then the plan is printed and predict.py ends before anything is read or written. On the CPU
with no card named nothing is measured and `auto` keeps the window batch predict.py always used (4; the model's own
for sampling windows).

Not counted, hence the margin: cuDNN's workspaces, the allocator's fragmentation, and the whole volumes a diffusion
walk keeps on the device beside its windows (the noisy volume, its conditions, the blended output and its weights:
a few float32 copies of the volume, 64 MiB each at 256^3).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from lightning_modules.diffusion.diffusion_module import DiffusionModule
from medvol.core.errors import MedvolError
from medvol.core.gpu_cards import GIB, card_named
from medvol.run.predict_config import NO_WINDOW
from medvol.run.preflight import MARGIN
from medvol.run.settings_bounds import AUTO, MAX_WINDOW_BATCH, PredictSizes
from medvol.volumes.mirroring import SPATIAL_AXES, MirrorAveraged

log = logging.getLogger("medvol")

# The window batch predict.py used before it was planned: `auto` keeps it on the CPU, where nothing is measured.
CPU_WINDOW_BATCH = 4
# A window call builds its fake inputs for `count` windows and returns them with the call to measure.
WindowCall = Callable[[int], tuple[list[torch.Tensor], Callable[[], Any]]]


@dataclass(frozen=True)
class Memory:
    """What a call is held against: the card's name, its memory (GiB) and whether it was named (`preflight=`)."""

    card: str
    gib: float
    named: bool

    def describe(self) -> str:
        return f"{self.card} {'has' if self.named else 'free'} {amount(int(self.gib * GIB))}"


@dataclass(frozen=True)
class WindowPlan:
    """The window batch chosen for `key` (`given`: what the command said), its predicted peak (bytes), the calls it
    was measured on and what it was held against."""

    key: str
    given: Any
    batch: int
    peak: int
    calls: str
    memory: Memory

    def line(self, precision: str = "32") -> str:
        shown = "under bf16 autocast" if precision == "bf16" else "in float32"
        return (f"inference preflight: {self.key}={self.batch} ({self.given}) {self.calls}: predicted peak "
                f"{amount(self.peak)} a call {shown} (+{MARGIN:.0%} margin); {self.memory.describe()}")


def device_memory(card: str | None, device: torch.device) -> Memory | None:
    """The card named by `preflight=` (`card`), else the free memory of the GPU predict.py runs on; None on the CPU."""
    if card:
        named = card_named(card)
        return Memory(named.name, named.memory_gib, True)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    # The weights are on the device already and the prediction counts them: what this process holds is its own.
    held = torch.cuda.memory_reserved(device)
    return Memory(torch.cuda.get_device_name(device), (free + held) / GIB, False)


@contextmanager
def fake_weights(module: torch.nn.Module, mode: Any) -> Iterator[torch.nn.Module]:
    """`module` with fake host tensors of `mode` for its parameters and buffers within, its own given back after.

    The fakes are made empty on the host whatever device the weights are on: nothing is copied off a GPU, and the
    windows, made on the host too, meet the weights on one device (the memory is counted in bytes, not by device).
    Shared tensors stay shared; 0-d buffers keep their value (code reads scalars)."""
    fakes: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in fakes:
            value = None if tensor.dim() else tensor.item()
            with mode:
                fakes[id(tensor)] = (torch.empty_strided(tuple(tensor.shape), tensor.stride(), dtype=tensor.dtype)
                                     if value is None else torch.tensor(value, dtype=tensor.dtype))
        return fakes[id(tensor)]

    kept = [(part, dict(part._parameters), dict(part._buffers)) for part in module.modules()]
    try:
        for part, parameters, buffers in kept:
            for name, parameter in parameters.items():
                if parameter is not None:
                    part._parameters[name] = torch.nn.Parameter(fake(parameter), parameter.requires_grad)
            for name, buffer in buffers.items():
                if buffer is not None:
                    part._buffers[name] = fake(buffer)
        yield module
    finally:
        for part, parameters, buffers in kept:
            part._parameters.update(parameters)
            part._buffers.update(buffers)


def call_peak(module: torch.nn.Module, call: WindowCall, count: int) -> int:
    """The device memory at the peak of one call of `count` windows, no gradient: `module`'s weights and buffers,
    the windows and the call's activations, in the caching allocator's blocks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from medvol.core.cuda_emulation import DeviceMemory, HostIntegers

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_weights(module, mode):
        with mode:
            inputs, run = call(count)
        memory = DeviceMemory()
        memory.track(*module.parameters(), *module.buffers(), *inputs)
        with mode, HostIntegers(), memory, torch.no_grad():
            if torch.is_autocast_enabled("cpu"):
                # bf16: autocast keeps each weight's bf16 copy from its first call to the end of predict.py's
                # autocast region; a call of one window first makes them, and they stay counted.
                _warm_up(call)
            memory.reset_peak()
            run()
    return memory.peak


def _warm_up(call: WindowCall) -> None:
    """One call of one window, its windows and activations let go after it."""
    _, run = call(1)
    run()


def amount(nbytes: int) -> str:
    """Bytes as GiB, or MiB below a tenth of one (a toy network's call)."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.1f} MiB"


def fits(peak: int, memory: Memory) -> bool:
    """Whether `peak` bytes plus the margin fit `memory`."""
    return peak / GIB * (1 + MARGIN) <= memory.gib


def largest_fitting(peak_of: Callable[[int], int], memory: Memory, cap: int = MAX_WINDOW_BATCH) -> tuple[int, int]:
    """(the largest batch in [1, cap] whose `peak_of` fits `memory`, its peak); (0, the peak at 1) when none does.
    The peak grows with the batch: the slope between 1 and 2 gives a guess, measured, then a bisection."""
    known = {1: peak_of(1)}
    if not fits(known[1], memory):
        return 0, known[1]
    low, high = 1, cap + 1  # fits at `low`; not at `high` (or `high` is past the cap)
    if cap >= 2:
        known[2] = peak_of(2)
        slope = max(known[2] - known[1], 1)
        guess = 1 + int((memory.gib * GIB / (1 + MARGIN) - known[1]) // slope)
        for probe in (min(max(guess, 2), cap), min(guess + 1, cap)):
            if low < probe < high:
                known[probe] = known.get(probe) or peak_of(probe)
                low, high = (probe, high) if fits(known[probe], memory) else (low, probe)
    while high - low > 1:
        middle = (low + high) // 2
        known[middle] = peak_of(middle)
        low, high = (middle, high) if fits(known[middle], memory) else (low, middle)
    return low, known[low]


def planned_batch(key: str, given: Any, memory: Memory, peak_of: Callable[[int], int], calls: str) -> WindowPlan:
    """The window batch for `key`: `given` when it is a whole number whose peak fits, else refused in one line naming
    the largest that fits; for `auto` the largest that fits. Refused when not even one window fits."""
    if given != AUTO:
        peak = peak_of(int(given))
        if fits(peak, memory):
            return WindowPlan(key, given, int(given), peak, calls, memory)
    best, best_peak = largest_fitting(peak_of, memory)
    if best == 0:
        raise MedvolError(f"inference preflight: one window {calls} predicts {amount(best_peak)} (+{MARGIN:.0%} "
                          f"margin); {memory.describe()}: not even one window fits; use a larger card or a smaller "
                          "`roi`")
    if given != AUTO:
        raise MedvolError(f"`{key}={given}` predicts {amount(peak)} a call (+{MARGIN:.0%} margin) {calls}; "
                          f"{memory.describe()}: the largest that fits is {key}={best} ({amount(best_peak)})")
    return WindowPlan(key, given, best, best_peak, calls, memory)


def shown(size: Sequence[int]) -> str:
    return "x".join(str(int(s)) for s in size)


def sliding_window_call(module: Any, roi: Sequence[int]) -> WindowCall | None:
    """predict.py's sliding-window call on `count` windows of `roi`, for the families that run one: the segmenter's
    logits (the mirrored copies averaged with its `tta`, nnU-Net's test-time mirroring) and the VQ-GAN's
    reconstruction; None for the others."""
    from lightning_modules.segmentation.segmentation import Segmenter

    if isinstance(module, Segmenter):
        axes = SPATIAL_AXES if module.tta else ()

        def segmentation(count: int) -> tuple[list[torch.Tensor], Callable[[], Any]]:
            window = torch.randn(count, int(module.hparams.in_channels), *roi)
            return [window], lambda: MirrorAveraged(module.net, axes)(window)

        return segmentation
    if hasattr(module, "gan_losses"):

        def reconstruction(count: int) -> tuple[list[torch.Tensor], Callable[[], Any]]:
            window = torch.rand(count, int(module.hparams.in_channels), *roi) * 2 - 1
            return [window], lambda: module(window)[0].clamp(-1.0, 1.0)

        return reconstruction
    return None


@dataclass(frozen=True)
class SamplingCall:
    """One kind of network call of a diffusion walk: its window, whether it is the whole volume (one call, whatever
    the batch), the call on `count` windows, and whose call it is (an X-ray-to-CT stage's)."""

    window: list[int]
    whole: bool
    call: WindowCall
    owner: str = ""

    def describe(self) -> str:
        return f"{self.owner}{'the whole' if self.whole else 'windows of'} {shown(self.window)}"


def sampling_calls(module: DiffusionModule) -> list[SamplingCall]:
    """The network calls of a diffusion walk: every X-ray-to-CT stage's (each its own network and window, the
    module's window batch for all), else the module's own on its `sampling_window`; none without one (the whole
    volume, whose size only the inputs give)."""
    from lightning_modules.xray2ct.module import XrayToCT
    from lightning_modules.xray2ct.stage_settings import as_size, window_of

    if isinstance(module, XrayToCT):
        stages = [*zip(module.previous_settings, module.previous, strict=True),
                  (dict(module.hparams), module.sampling_network)]
        return [SamplingCall(window_of(settings), window_of(settings) == as_size(settings["size"]),
                             xray_call(module, network, window_of(settings), int(settings["stage"]) > 1),
                             f"stage {settings['stage']}: ")
                for settings, network in stages]
    if module.sampling_window is None:
        return []
    window = list(module.sampling_window)
    return [SamplingCall(window, False, denoiser_call(module, window))]


def last_step(module: DiffusionModule) -> int:
    """The walk's first (noisiest) training step, read before the fake mode (a fake tensor has no value to read)."""
    return int(module.train_timesteps[-1])


def denoiser_call(module: DiffusionModule, window: list[int]) -> WindowCall:
    """The family's own call (`network_output`) on `count` windows, with the conditioning it takes made as its
    export makes it (`conditioning_examples`: a condition volume, the spacing, coordinates)."""

    step = last_step(module)

    def call(count: int) -> tuple[list[torch.Tensor], Callable[[], Any]]:
        x_t = torch.randn(count, module.denoised_grid(window)[0], *window)
        conditioning = {name: pair[0] for name, pair in module.conditioning_examples(x_t, x_t).items()}
        t, network = torch.full((count,), step, dtype=torch.long), module.sampling_network
        return [x_t, *conditioning.values()], lambda: module.network_output(network, x_t, t, **conditioning)

    return call


def xray_call(module: Any, network: torch.nn.Module, window: list[int], cascaded: bool) -> WindowCall:
    """An X-ray-to-CT stage's call on `count` windows: the noisy CT, the step, each window's radiographs and, from
    stage 2, its cut of the upsampled previous stage and the three coordinate channels."""

    step = last_step(module)

    def call(count: int) -> tuple[list[torch.Tensor], Callable[[], Any]]:
        x_t = torch.randn(count, 1, *window)
        views = torch.rand(count, len(module.hparams.views), *module.hparams.xray_size) * 2 - 1
        t = torch.full((count,), step, dtype=torch.long)
        if not cascaded:
            return [x_t, views], lambda: module.network_output(network, x_t, t, views)
        previous, coordinates = torch.randn(count, 1, *window), torch.rand(count, 3, *window) * 2 - 1
        return ([x_t, views, previous, coordinates],
                lambda: module.network_output(network, x_t, t, views, previous, coordinates))

    return call


def plan_sliding_window(module: Any, roi: Sequence[int], given: Any, memory: Memory) -> WindowPlan | None:
    """predict.py's `sw_batch_size` for the family's sliding window of `roi`; None where it runs none."""
    call = sliding_window_call(module, roi)
    if call is None:
        return None
    return planned_batch("sw_batch_size", given, memory, lambda count: call_peak(module, call, count),
                         f"on windows of {shown(roi)}")


def plan_sampling(module: DiffusionModule, given: Any, memory: Memory) -> WindowPlan | None:
    """The diffusion walk's `sampling_window_batch_size`: the largest whose every kind of windowed call (each
    X-ray-to-CT stage's) fits, a whole-volume stage's one call held against the memory too; None without windows."""
    calls = sampling_calls(module)
    windowed = [c for c in calls if not c.whole]
    if not windowed:
        return None
    described = ", ".join(c.describe() for c in calls)
    whole = max((call_peak(module, c.call, 1) for c in calls if c.whole), default=0)

    def peak_of(count: int) -> int:
        # One batch serves every stage's windows: the stage whose call takes most sets it.
        return max(whole, *(call_peak(module, c.call, count) for c in windowed))

    return planned_batch("sampling_window_batch_size", given, memory, peak_of, f"on {described}")


# The decoder slabs tried (values a slab), powers of two up to the bound of a run's own (`settings_bounds.LDM`).
SLAB_EXPONENTS = range(16, 32)


def decoding_call(module: Any, latent: Sequence[int], slab: int) -> WindowCall:
    """The LDM's decoding (`images`: snapped to the codes, the first stage's decoder by depth slabs of `slab`
    values) of one latent of shape (1, C, D, H, W), every whole activation kept on the device."""

    def call(count: int) -> tuple[list[torch.Tensor], Callable[[], Any]]:
        latents = torch.randn(*latent)

        def run() -> None:
            kept = module.hparams.decode_slab_elements, module.hparams.decode_offload, module.progress
            module.hparams.decode_slab_elements, module.hparams.decode_offload, module.progress = slab, False, False
            try:
                module.images(latents)
            finally:
                module.hparams.decode_slab_elements, module.hparams.decode_offload, module.progress = kept

        return [latents], run

    return call


def plan_decoding(module: Any, given: Any, memory: Memory) -> WindowPlan | None:
    """The LDM's `decode_slab_elements` for a sample from noise (its size is known before any input): the largest
    power of two whose decoding, whole activations on the device, fits; a number given is checked. None for other
    families and conditional LDMs (their size is the input's); refused when no slab keeps the activations on the
    device (`model.decode_offload=true` keeps them on the host)."""
    if not hasattr(module, "unconditional_size") or module.cond_channels:
        return None
    size = module.unconditional_size()
    latent = [1, int(module.first_stage.embedding_dim),
              *(int(s) // int(d) for s, d in zip(size, module.first_stage.downsample, strict=True))]
    key, calls = "decode_slab_elements", f"decoding a {shown(latent[2:])} latent to {shown(size)}"

    def peak_of(slab: int) -> int:
        return call_peak(module, decoding_call(module, latent, slab), 1)

    if given != AUTO:
        peak = peak_of(int(given))
        if fits(peak, memory):
            return WindowPlan(key, given, int(given), peak, calls, memory)
    # The peak grows with the slab: the largest exponent that fits, by bisection.
    low, high = SLAB_EXPONENTS[0], SLAB_EXPONENTS[-1] + 1
    smallest = peak_of(2**low)
    if not fits(smallest, memory):
        raise MedvolError(f"inference preflight: {calls} by slabs of {2**low} values predicts {amount(smallest)} "
                          f"(+{MARGIN:.0%} margin); {memory.describe()}: no slab keeps the decoder's activations on "
                          "the device; model.decode_offload=true keeps them in host memory")
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(peak_of(2**middle), memory) else (low, middle)
    best = 2**low
    if given != AUTO:
        raise MedvolError(f"`{key}={given}` predicts {amount(peak)} (+{MARGIN:.0%} margin) {calls}; "
                          f"{memory.describe()}: the largest power of two that fits is {key}={best} "
                          f"({amount(peak_of(best))})")
    return WindowPlan(key, given, best, peak_of(best), calls, memory)


@dataclass(frozen=True)
class InferencePlan:
    """The window batches and decoder slab predict.py runs with (None: the model's own), and whether a card was
    named (the run ends after the plan)."""

    sw_batch_size: int
    sampling_window_batch_size: int | None
    decode_slab_elements: int | None
    named: bool

    def apply(self, module: Any) -> None:
        """Give the module the planned sampling batch and decoder slab."""
        if self.sampling_window_batch_size is not None:
            module.sampling_window_batch_size = self.sampling_window_batch_size
        if self.decode_slab_elements is not None:
            module.hparams.decode_slab_elements = self.decode_slab_elements




@contextmanager
def emulated_precision(precision: str) -> Iterator[None]:
    """Within: the fake calls run as `precision` runs them on a GPU (bf16: CPU autocast with CUDA's op lists)."""
    if precision != "bf16":
        yield
        return
    from medvol.core.cuda_emulation import cuda_autocast_policy, gpu_autocast

    with cuda_autocast_policy(torch.bfloat16), gpu_autocast(torch.bfloat16):
        yield


def plan_inference(module: Any, given: PredictSizes, device: torch.device, precision: str = "32",
                   card: str | None = None, roi: Sequence[int] | None = None) -> InferencePlan:
    """The window batches (and the LDM's decoder slab) of this prediction, before any subject is read: on a GPU or the
    `card` `preflight=` names, each `auto` of `given` (checked already, by the request) the largest whose predicted call
    fits and each number checked; on the CPU the command's numbers, `auto` the window batch predict.py always used (4)
    and the model's own sampling windows and slab. One log line per planned call. `roi` is the sliding window (read
    only for a family that runs one)."""
    memory = device_memory(card, device)
    own = {key: None if getattr(given, key) == AUTO else int(getattr(given, key)) for key in PredictSizes.model_fields}
    if memory is None:
        return InferencePlan(own["sw_batch_size"] or CPU_WINDOW_BATCH, own["sampling_window_batch_size"],
                             own["decode_slab_elements"], False)
    plans = []
    with emulated_precision(precision):
        if sliding_window_call(module, (1, 1, 1)) is not None:
            if roi is None:
                raise MedvolError(NO_WINDOW)
            plans.append(plan_sliding_window(module, roi, given.sw_batch_size, memory))
        if isinstance(module, DiffusionModule):
            plans.append(plan_sampling(module, given.sampling_window_batch_size, memory))
        plans.append(plan_decoding(module, given.decode_slab_elements, memory))
    chosen = {plan.key: plan.batch for plan in plans if plan is not None}
    for plan in plans:
        if plan is not None:
            log.info("%s", plan.line(precision))
    if not chosen:
        log.info("inference preflight: %s runs no windowed network call to plan; %s", type(module).__name__,
                 memory.describe())
    return InferencePlan(chosen.get("sw_batch_size", own["sw_batch_size"] or CPU_WINDOW_BATCH),
                         chosen.get("sampling_window_batch_size", own["sampling_window_batch_size"]),
                         chosen.get("decode_slab_elements", own["decode_slab_elements"]), memory.named)
