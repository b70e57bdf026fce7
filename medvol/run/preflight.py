"""Know before you run: a GPU training step's peak memory, work and time, predicted on the CPU before the first step.

Before a run on a GPU reads its data, the run's own module, built from its config, takes one training step on fake
tensors (`FakeTensorMode`: shapes, dtypes and autograd, no data; nothing of the batch's size is allocated) at the
configured batch and volume, under CUDA's autocast lists, its device memory counted as the CUDA caching allocator
counts it (`medvol.core.cuda_emulation`). One line says the predicted peak per rank beside the card's free memory;
a step that will not fit stops there in one line naming the changes that would fit, each predicted. `preflight=H100`
(or another card of `medvol.core.gpu_cards`, or a size such as `24GiB`) does the same for that card on any machine,
and the run stops after the line. On the CPU with no card named nothing runs.

Not counted, hence `MARGIN`: cuDNN's and cuBLAS's workspaces of the chosen kernels and the allocator's
fragmentation. cuDNN's benchmark trials (`trainer.benchmark`, hardware=gpu) are not counted either: they take up to
the largest free block (PyTorch's `getMaxWorkspaceSize` / `get_available_workspace`) and drop the kernels that do
not fit, so they raise `max_memory_allocated` on a large card (docs/preflight.md) but never stop a step that fits.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any
from unittest import mock

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from medvol.core.build import build_model
from medvol.core.errors import MedvolError
from medvol.core.gpu_cards import GIB, Card, card_named, card_of_device_name
from medvol.run.planning import plan_before_data, wants_plan

log = logging.getLogger("medvol")

# The share of the prediction kept free for what it does not count (see the module's docstring).
MARGIN = 0.10
_GPU_ACCELERATORS = ("auto", "gpu", "cuda")
# Measured step rates as a share of the card's dense bf16 peak, by family: the step's FLOPs (the emulation's count) over
# its measured time, on the rounds' cards (benchmarks/gpu/gpu_estimates.py MEASURED_STEP_S and the round summaries).
MEASURED_EFFICIENCY = {
    "VQGAN": (1.60 / 0.0839 / 989, "CTPA VQ-GAN batch 1, 83.9 ms on the H100, 2026-11-28"),
    "ConditionalDiffusion": (9.44 / 0.162 / 989, "Fast-DDPM seed step, 162 ms on the H100, 2026-11-28"),
    "Segmenter": (5.72 / 0.0915 / 989, "planned DynUNet batch 2, 91.5 ms on the H100, 2026-11-28"),
    "LatentDiffusion": (278.77 / 1.373 / 989, "CTPA LDM at 128^3 latents, 1.37 s on the H100, 2026-11-28"),
    "XrayToCT": (58.68 / 0.410 / 989, "X-ray-to-CT stage 2 batch 8, 0.410 s on the H200, 2026-11-27"),
}
# Families without a measured step: the median of the measured ones (the segmentation step's).
DEFAULT_EFFICIENCY = MEASURED_EFFICIENCY["Segmenter"]
# `hardware.fit`'s search: up to a run record's bound on `dataset.batch_size` (`medvol.run.settings_bounds`), with
# probes on the line through the known predictions before it halves.
MAX_FIT_BATCH = 4096
LINEAR_PROBES = 3


@dataclass
class Prediction:
    """One training step's peak device memory per rank (bytes), its FLOPs, and what it was predicted for."""

    peak: int
    flops: int
    batch: int
    size: list[int]


@dataclass
class Preflight:
    """What the preflight decided: `stop` (a card was named: the run ends after its line), `after_planning` (the
    network comes from the data: the preflight runs again on the planned config), `batch` (`hardware.fit`'s choice,
    set on the run's config once planned)."""

    stop: bool = False
    after_planning: bool = False
    batch: int | None = None


def preflight(cfg: DictConfig, recorded: bool = False, planned: bool = False) -> Preflight:
    """Predict the run's training step on its GPU (or the card `preflight` names) and print it in one line.

    The network is the one the run will train: a planned segmentation run's plan where it is known before the data
    (`recorded`: a resume's record holds it; the run folder's plan.json; a plan the config gives whole), else the step
    waits for planning (`after_planning`) and this is called again with `planned=True` on the planned config. With
    `hardware.fit=true` (not on a resume: its record keeps the batch) the largest batch that fits is chosen.
    Raises `MedvolError` in one line, naming the changes that would fit, when the step will not fit the card. On the
    CPU with no card named: nothing, at no cost.
    """
    fit = fit_wanted(cfg) and not recorded
    named = cfg.get("preflight")
    if named:
        card, free_gib = card_named(str(named)), None
    elif _trains_on_a_gpu(cfg):
        free, _ = torch.cuda.mem_get_info()
        free_gib = free / GIB
        device = torch.cuda.get_device_name()
        card = card_of_device_name(device) or Card(device, free_gib, None, "this machine")
    else:
        if fit:
            log.info("preflight: hardware.fit: no GPU and no card named (preflight=H100): dataset.batch_size stays %s",
                     cfg.dataset.get("batch_size"))
        return Preflight()
    known = cfg if planned else plan_before_data(cfg, "gpu", recorded)
    if known is None:
        log.info("preflight: the network comes from the data (%s); predicted once planned, before the cache is "
                 "built or a rank starts", _waits_for(cfg))
        return Preflight(after_planning=True)
    available = card.memory_gib if free_gib is None else free_gib
    precision = run_precision(known, named=bool(named))
    prediction = predict(known, precision)
    if prediction is None:
        log.info("preflight: no step emulation for %s yet; nothing predicted", str(cfg.model._target_))
        return Preflight(stop=bool(named))
    if fit:
        prediction = largest_fitting_batch(known, precision, prediction, available)
    peak_gib = prediction.peak / GIB
    line = (f"preflight: predicted peak {peak_gib:.2f} GiB per rank (+{MARGIN:.0%} margin) at batch "
            f"{prediction.batch} of {'x'.join(map(str, prediction.size))}, {precision}; {card.name} "
            f"{'free' if free_gib is not None else 'has'} {available:.2f} GiB; {step_time(known, card, prediction)}")
    if not _fits(prediction, available):
        fixes = fitting_changes(known, precision, prediction, available)
        raise MedvolError(f"{line}; will not fit: " + (f"would fit: {fixes}" if fixes else
                                                         "no smaller batch, volume or setting found that fits"))
    # A named card's run ends here, before a rank starts or the cache is built.
    log.info("%s", line)
    if fit:
        log.info("preflight: hardware.fit: dataset.batch_size=%d, the largest batch that fits %s with the %.0f%% "
                 "margin (configured: %s)", prediction.batch, card.name, MARGIN * 100, known.dataset.get("batch_size"))
    return Preflight(stop=bool(named), batch=prediction.batch if fit else None)


def _waits_for(cfg: DictConfig) -> str:
    return "its plan" if wants_plan(cfg) else "model.num_classes is null: its classes"


def fit_wanted(cfg: DictConfig) -> bool:
    """`hardware.fit`: true or false (absent: false); anything else is refused in one line."""
    value = OmegaConf.select(cfg, "hardware.fit", default=False)
    if not isinstance(value, bool):
        raise MedvolError(f"`hardware.fit` is {value!r}; expected true (choose the largest batch that fits) or false")
    return value


def _fits(prediction: Prediction, available_gib: float) -> bool:
    return prediction.peak / GIB * (1 + MARGIN) <= available_gib


def largest_fitting_batch(cfg: DictConfig, precision: str, first: Prediction, available_gib: float) -> Prediction:
    """The prediction at the largest batch (up to `MAX_FIT_BATCH`) whose peak plus the margin fits `available_gib`;
    `first` where not even batch 1 fits. A step's peak grows about linearly with the batch, so each probe is the
    batch where the line through the two nearest known predictions meets the limit, kept strictly between the largest
    batch known to fit and the smallest known not to (halving after `LINEAR_PROBES` probes): about four
    predictions."""
    known = {first.batch: first}
    # The largest batch known to fit (0: none yet) and the smallest known not to.
    low, high = (first.batch, MAX_FIT_BATCH + 1) if _fits(first, available_gib) else (0, first.batch)
    probes = 0
    while high - low > 1:
        # A second point for the line: the batch doubled (it fits) or halved (it does not).
        if len(known) == 1:
            batch = min(2 * first.batch, high - 1) if low else max(1, first.batch // 2)
        elif probes < LINEAR_PROBES:
            batch = min(max(_on_the_line(known, available_gib), low + 1), high - 1)
        else:
            batch = (low + high) // 2
        probes += 1
        changed = cfg.copy()
        with open_dict(changed):
            changed.dataset.batch_size = batch
        guess = predict(changed, precision)
        assert guess is not None
        known[batch] = guess
        if _fits(guess, available_gib):
            low = batch
        else:
            high = batch
    return known.get(low, first)


def _on_the_line(known: dict[int, Prediction], available_gib: float) -> int:
    """The batch where the peak, on the line through the two known batches nearest the limit, reaches it."""
    limit = available_gib / (1 + MARGIN) * GIB
    (b1, p1), (b2, p2) = sorted(sorted(known.items(), key=lambda item: abs(item[1].peak - limit))[:2])
    slope = (p2.peak - p1.peak) / (b2 - b1)
    return int(b1 + (limit - p1.peak) // slope) if slope > 0 else b2 * 2


def _trains_on_a_gpu(cfg: DictConfig) -> bool:
    accelerator = str(cfg.trainer.get("accelerator", "auto")).lower()
    return accelerator in _GPU_ACCELERATORS and torch.cuda.is_available() and cfg.get("train", True)


def run_precision(cfg: DictConfig, named: bool) -> str:
    """The run's precision; for a named card, bf16-mixed where the hardware file leaves it to the machine
    (`${auto_precision:}` gives 32-true on a CPU, bf16-mixed on every listed card)."""
    raw = OmegaConf.to_container(cfg.trainer, resolve=False).get("precision")
    if named and isinstance(raw, str) and "auto_precision" in raw:
        return "bf16-mixed"
    return str(cfg.trainer.get("precision", "32-true"))


def _autocast(precision: str) -> Callable[[], AbstractContextManager]:
    if precision.startswith("bf16"):
        return partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    if precision.startswith("16"):
        return partial(torch.autocast, "cpu", dtype=torch.float16)
    return nullcontext


def volume_key(cfg: DictConfig) -> tuple[str, list[int]] | None:
    """The config key that sets the training volume's size, and the size (D, H, W)."""
    candidates = ["model.patch_size", "dataset.patch_size", "dataset.transforms.spatial_size", "dataset.size"]
    for key in candidates:
        value = OmegaConf.select(cfg, key)
        if value is None:
            continue
        size = [int(value)] * 3 if isinstance(value, int) else [int(v) for v in value]
        return key, size
    return None


def predict(cfg: DictConfig, precision: str) -> Prediction | None:
    """One step of the run's module on fake tensors, twice (the second with the optimizer's state): its peak per
    rank and the second step's FLOPs; None for a family without a step emulation here."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from medvol.core.cuda_emulation import as_fake, cuda_autocast_policy, measured_step

    module = build_model(cfg.model).train()
    step = _family_step(module)
    if step is None:
        return None
    found = volume_key(cfg)
    size = found[1] if found else [64] * 3
    batch = int(cfg.dataset.get("batch_size", 1) or 1)
    autocast = _autocast(precision)
    lower = torch.float16 if precision.startswith("16") else torch.bfloat16
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    module.log = module.log_dict = lambda *a, **k: None  # type: ignore[method-assign]
    with cuda_autocast_policy(lower):
        module = as_fake(module, mode)
        with mode:
            optimizers = _optimizers(module)
            inputs, run = step(module, optimizers, batch, size, autocast)
        memory, flops = measured_step(run, [*module.parameters(), *module.buffers(), *inputs], mode)
    peak = memory.peak
    devices = _devices(cfg)
    if devices > 1:
        # DDP's gradient buckets: a flat copy of every gradient, per rank.
        peak += sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return Prediction(peak, flops.total, batch, size)


def _devices(cfg: DictConfig) -> int:
    devices = cfg.trainer.get("devices", 1)
    return int(devices) if isinstance(devices, int) or str(devices).isdigit() else 1


def _optimizers(module: torch.nn.Module) -> list[torch.optim.Optimizer]:
    configured = module.configure_optimizers()
    if isinstance(configured, dict):
        configured = configured["optimizer"]
    if isinstance(configured, tuple) and len(configured) == 2 and isinstance(configured[0], list):
        configured = configured[0]
    items = configured if isinstance(configured, list | tuple) else [configured]
    return [item["optimizer"] if isinstance(item, dict) else item for item in items]


Step = Callable[..., tuple[list[torch.Tensor], Callable[[], None]]]


def _family_step(module: torch.nn.Module) -> Step | None:
    from lightning_modules.diffusion.fast_ddpm import ConditionalDiffusion
    from lightning_modules.ldm.latent_diffusion import LatentDiffusion
    from lightning_modules.segmentation.segmentation import Segmenter
    from lightning_modules.xray2ct.module import XrayToCT

    if hasattr(module, "gan_losses"):
        return _gan_step
    if isinstance(module, Segmenter):
        return _segmentation_step
    if isinstance(module, XrayToCT):
        return _xray2ct_step
    if isinstance(module, LatentDiffusion):
        return _latent_step
    if isinstance(module, ConditionalDiffusion):
        return _conditional_step
    return None


def _automatic(module: Any, optimizers: list[torch.optim.Optimizer], batch: dict[str, Any],
               autocast: Callable[[], AbstractContextManager]) -> Callable[[], None]:
    """Lightning's automatic step: the module's own `training_step`, backward, the optimizer, the EMA update."""

    def run() -> None:
        with autocast():
            loss = module.training_step(batch, 0)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if getattr(module, "ema", None) is not None:
            module.ema.update(module.network)

    return run


def _conditional_step(module: Any, optimizers: list, batch: int, size: list[int], autocast: Any) -> Any:
    image = torch.rand(batch, module.image_channels, *size) * 2 - 1
    inputs = {module.hparams.image_key: image}
    if module.cond_from_batch:
        inputs["cond"] = torch.rand(batch, module.cond_channels, *size) * 2 - 1
    return list(inputs.values()), _automatic(module, optimizers, inputs, autocast)


def _latent_step(module: Any, optimizers: list, batch: int, size: list[int], autocast: Any) -> Any:
    """The LDM trains on latents its dataset cached (`cached_transform`): the batch holds them, not the images. Its
    latent scale is computed from the data before the first step; any positive number steps the same memory."""
    module._scale = 1.0
    factors = [int(f) for f in module.first_stage.downsample]
    channels = int(module.first_stage.embedding_dim)
    latent = torch.randn(batch, channels, *[s // f for s, f in zip(size, factors, strict=True)])
    # Each sample's affine, read for its voxel spacing where spacing conditions the model.
    inputs = {"latent": latent, module.hparams.image_key: None, "affine": torch.eye(4).expand(batch, 4, 4)}
    return [latent], _automatic(module, optimizers, inputs, autocast)


def _xray2ct_step(module: Any, optimizers: list, batch: int, size: list[int], autocast: Any) -> Any:
    """A stage's batch: its whole CT at the stage's size and the radiographs; crops cut at the corner (MONAI's
    SpatialCrop wraps a sample in a MetaTensor, which cannot hold a fake tensor: where a crop lies changes no
    memory)."""
    from lightning_modules.xray2ct.module import as_size

    edge = as_size(module.hparams.size)
    inputs = {
        "image": torch.rand(batch, 1, *edge) * 2 - 1,
        "xray": torch.rand(batch, len(module.hparams.views), *module.hparams.xray_size) * 2 - 1,
        "affine": torch.eye(4).expand(batch, 4, 4),
    }
    step = _automatic(module, optimizers, inputs, autocast)

    def run() -> None:
        with mock.patch("lightning_modules.xray2ct.module.random_crops", _corner_crops):
            step()

    return [inputs["image"], inputs["xray"]], run


def _corner_crops(volumes: list[torch.Tensor], crop: list[int]) -> list[torch.Tensor]:
    channels = [v.shape[1] for v in volumes]
    stacked = torch.cat(list(volumes), dim=1)
    return list(stacked[:, :, : crop[0], : crop[1], : crop[2]].contiguous().split(channels, dim=1))


def _segmentation_step(module: Any, optimizers: list, batch: int, size: list[int], autocast: Any) -> Any:
    """The segmenter's loss on a patch (its patch sampling reads the labels' values, which fake tensors lack)."""
    image = torch.randn(batch, int(module.hparams.in_channels), *size)
    # Regions: a binary channel each; classes: one channel of label values, as the loss takes them.
    channels = module.scheme.out_channels if module.scheme.is_regions else 1
    target = (torch.rand(batch, channels, *size) > 0.9).to(torch.uint8)

    def run() -> None:
        with autocast():
            loss = module.training_loss(module(image), target)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return [image, target], run


def _gan_step(module: Any, optimizers: list, batch: int, size: list[int], autocast: Any) -> Any:
    """The VQ-GAN's manual step with the discriminators on: their update, then the generator's."""
    patches = torch.rand(batch, int(getattr(module.hparams, "in_channels", 1) or 1), *size) * 2 - 1
    opt_ae, opt_disc = optimizers

    def run() -> None:
        with autocast():
            step = module.gan_losses(patches, True)
        if step.discriminator_loss is not None:
            step.discriminator_loss.backward(inputs=module.discriminator_parameters())
            opt_disc.step()
            opt_disc.zero_grad(set_to_none=True)
        step.generator_objective.backward()
        opt_ae.step()
        opt_ae.zero_grad(set_to_none=True)

    return [patches], run


def step_time(cfg: DictConfig, card: Card, prediction: Prediction) -> str:
    """The step's work and its time on `card` at the family's measured share of the card's peak rate."""
    work = f"{prediction.flops / 1e12:.2f} TFLOP a step"
    if card.bf16_tflops is None:
        return work
    family = str(cfg.model._target_).rsplit(".", 1)[-1]
    efficiency, source = MEASURED_EFFICIENCY.get(family, DEFAULT_EFFICIENCY)
    seconds = prediction.flops / (card.bf16_tflops * 1e12 * efficiency)
    text = f"{work}, ~{seconds:.2f} s at {efficiency:.1%} of its {card.bf16_tflops:.0f} TFLOP/s ({source})"
    steps = _steps_per_epoch(cfg)
    return text + (f", ~{seconds * steps / 60:.1f} min an epoch of {steps} steps" if steps else "")


def _steps_per_epoch(cfg: DictConfig) -> int | None:
    """Training batches an epoch where the config says how many subjects there are (the phantoms); else None."""
    limit = cfg.trainer.get("limit_train_batches")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        return limit
    subjects = cfg.dataset.get("num_subjects")
    if not isinstance(subjects, int):
        return None
    train = subjects * (1 - float(cfg.dataset.get("val_fraction", 0)) - float(cfg.dataset.get("test_fraction", 0)))
    return max(1, math.ceil(train / (int(cfg.dataset.get("batch_size", 1)) * _devices(cfg))))


def fitting_changes(cfg: DictConfig, precision: str, prediction: Prediction, available_gib: float) -> str:
    """The changes that make the step fit, each predicted: a smaller batch, a smaller volume, activation
    checkpointing or bf16 GroupNorm where the family has them, bf16 mixed precision."""
    candidates: list[tuple[str, Any, str]] = []
    if prediction.batch > 1:
        candidates += [("dataset.batch_size", b, precision) for b in _halvings(prediction.batch)]
    found = volume_key(cfg)
    if found:
        key, size = found
        for divisor in (4 / 3, 2):
            smaller = [max(16, int(s / divisor) // 16 * 16) for s in size]
            if smaller != size:
                value = smaller[0] if key == "dataset.size" else smaller
                candidates.append((key, value, precision))
    for key in ("model.activation_checkpointing", "model.low_precision_norm"):
        if OmegaConf.select(cfg, key) is False:
            candidates.append((key, True, precision))
    if not precision.startswith(("bf16", "16")):
        candidates.append(("trainer.precision", "bf16-mixed", "bf16-mixed"))
    fits = []
    for key, value, changed_precision in candidates:
        changed = cfg.copy()
        with open_dict(changed):
            OmegaConf.update(changed, key, value, merge=False)
        guess = predict(changed, changed_precision)
        if guess is not None and guess.peak / GIB * (1 + MARGIN) <= available_gib:
            shown = "x".join(map(str, value)) if isinstance(value, list) else str(value).lower()
            fits.append(f"{key}={shown} ({guess.peak / GIB:.2f} GiB)")
            if key == "dataset.batch_size":
                # The largest batch that fits is the one worth naming.
                candidates = [c for c in candidates if c[0] != "dataset.batch_size"]
    return ", ".join(fits)


def _halvings(batch: int) -> list[int]:
    halves, b = [], batch // 2
    while b >= 1:
        halves.append(b)
        b //= 2
    return halves
