"""What every medvol LightningModule shares: optimizer building, checkpoint identity, manual-step policy."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import move_data_to_device

from medvol.core.plain_values import plain
from medvol.volumes.sliding_window import SlidingWindow

MODEL_KEY = "medvol_model"
# Checkpoint key of the training data's fingerprint (`VolumeDataModule.fingerprint`: spacing, orientation, intensity).
DATA_KEY = "medvol_data"


@dataclass(frozen=True)
class ExportedNetwork:
    """A network of a trained family as export.py writes it (TorchScript, ONNX): plain tensors in and out.

    Args:
        name: the file's name (`<name>.onnx`, `<name>.ts`).
        network: an eval-mode module whose forward takes the `inputs` positionally and returns one tensor.
        inputs: input name -> an example tensor (the training size; what tracing runs).
        output: the output's name.
        dynamic: input or output name -> {axis: name} of the axes that may vary (batch, spatial); the others are
            fixed at the example's size.
        larger: input name -> a second example of other sizes along the dynamic axes (the parity check's second
            size: another batch, and other spatial sizes where the network allows them).
        about: what the network computes, its inputs' and output's meaning and units (export.json, docs).
    """

    name: str
    network: torch.nn.Module
    inputs: dict[str, torch.Tensor]
    output: str
    dynamic: dict[str, dict[int, str]]
    larger: dict[str, torch.Tensor]
    about: dict[str, Any] = field(default_factory=dict)


def spatial_examples(
    channels: int, size: Sequence[int], multiple: Sequence[int], batch: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded random (batch, C, *size) example and a larger one, `multiple` more voxels along each axis (what the
    network's halvings divide), for a network with dynamic spatial axes."""
    generator = torch.Generator().manual_seed(0)
    first = torch.randn(batch, channels, *[int(s) for s in size], generator=generator)
    larger = [int(s) + int(m) for s, m in zip(size, multiple, strict=True)]
    return first, torch.randn(batch + 1, channels, *larger, generator=generator)


DYNAMIC_AXES = {0: "batch", 2: "depth", 3: "height", 4: "width"}


def class_path(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class MedvolModule(pl.LightningModule):
    """Base class of the model families.

    Families that use manual optimization (GANs) cannot rely on Lightning for gradient
    accumulation and clipping; `run()` hands the trainer's settings to
    `set_manual_step_policy` and this class applies clipping after AMP unscaling.
    """

    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    # What the model saw of its training data; set by the run, kept in checkpoints, read by predict.py.
    training_data: dict[str, Any] | None = None
    # Whether the network reads each volume whole at the training crop/pad size (a survival or classification model
    # pools one volume into one prediction): predict.py then keeps the run's `spatial_size`, as test=true saw it.
    fixed_input_size: bool = False

    def set_manual_step_policy(
        self,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
    ) -> None:
        if int(accumulate_grad_batches) < 1:
            raise ValueError(f"`trainer.accumulate_grad_batches` must be >= 1, got {accumulate_grad_batches}")
        self.accumulate_grad_batches = int(accumulate_grad_batches)
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm or "norm"

    def is_accumulation_boundary(self, batch_idx: int) -> bool:
        """True on the micro-batch after which the optimizers step (manual optimization)."""
        if (batch_idx + 1) % self.accumulate_grad_batches == 0:
            return True
        return bool(self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)

    @property
    def batches_seen(self) -> int:
        """Training batches processed so far in the whole run (restored on resume)."""
        return int(self.trainer.fit_loop.epoch_loop.batch_progress.total.ready) - 1

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Called after the AMP scaler has unscaled the gradients, so the threshold means what it says.
        if not self.automatic_optimization and self.gradient_clip_val:
            self.clip_gradients(
                optimizer,
                gradient_clip_val=self.gradient_clip_val,
                gradient_clip_algorithm=self.gradient_clip_algorithm,
            )

    def predict_volumes(
        self, batch: dict[str, Any], window: SlidingWindow, extras: Sequence[str] = ()
    ) -> dict[str, Any]:
        """Outputs for one batch of whole volumes of any size (`predict.py`), in the `test_step` contract.

        Families whose forward maps a volume to a volume run it through `window` (the training patch
        as the window); the default is `test_step` on the device, for families that need the batch's
        references (a sample's target, a CT's radiographs) or see a whole volume at once (risk, class).
        `extras` names optional outputs asked for (`codes` for the VQ-GAN), returned as `"arrays"`
        (name -> (B, ...) tensor, written as `<subject>_<name>.npy`).
        """
        with warnings.catch_warnings():
            # test_step logs its metrics; outside a Trainer (predict.py) Lightning warns and drops them.
            warnings.filterwarnings("ignore", message=r".*self\.log\(\)")
            return self.test_step(move_data_to_device(batch, self.device), 0)

    # Condition-only generation (predict.py on the inputs a patient has: a T1 for a T1 -> T2 model) ---------

    def generation_inputs(self) -> dict[str, int]:
        """The batch keys (name -> channel count) this family generates its outputs from when the batch has no
        target; empty for families that predict from the `image` they are given (or need the target)."""
        return {}

    @property
    def refines_resolution(self) -> bool:
        """Whether generation turns a coarse input into a volume at the training spacing (super-resolution):
        predict.py then writes the output on the model grid and refuses inputs that are not coarser."""
        return False

    def generate_volumes(self, batch: dict[str, Any], draw: int = 0) -> dict[str, Any]:
        """Outputs from the batch's `generation_inputs` alone, in the `test_step` contract without metrics.

        `draw` k is the k-th seeded sample of each subject; draw 0 is the sample `test_step` gives for the
        same subject and condition (the same code path). Families with `generation_inputs` override it.
        """
        raise NotImplementedError(f"{class_path(self)} generates nothing without its target")

    # Export (export.py: TorchScript, ONNX, a MONAI bundle) ---------------------------------------------------

    def exported_networks(self, size: Sequence[int]) -> list[ExportedNetwork]:
        """The networks of this family that can leave medvol, with example inputs of the training `size` (D, H, W);
        empty where the model is no network a server can call (families override it)."""
        return []

    def not_exportable(self) -> str:
        """Why a family cannot be exported as a bundle (or, where `exported_networks` is empty, at all), for the one
        line that refuses it."""
        return "it has no network export defined"

    def bundle_network(self) -> torch.nn.Module | None:
        """The network a MONAI bundle's sliding window calls (`models/model.ts`): a whole window in, the output
        predict.py blends out; None where predict.py does more than blend windows (a sampler loop, a risk)."""
        return None

    @classmethod
    def check_settings(cls, settings: Mapping[str, Any]) -> None:
        """Refuse (`MedvolError`) model settings that name files unusable for this family (a latent model's first
        stage), from the `model` config alone: the run calls it with its other checks, before anything is built."""

    @classmethod
    def check_cascade(cls, stages: Mapping[int, Mapping[str, Any]]) -> None:
        """Refuse (`MedvolError`) the `model` settings of a cascade's stages of this family (stage number -> settings)
        that cannot work together; the cascade runner calls it before its first stage starts. Default: any."""

    @classmethod
    def generates_from_noise(cls, settings: Mapping[str, Any]) -> bool:
        """Whether the model that `settings` (its `model` config) builds generates volumes from noise alone, so
        predict.py runs it with no input (an unconditional latent diffusion model). Default no."""
        return False

    @classmethod
    def restoring_settings(cls, hyper_parameters: dict[str, Any]) -> dict[str, Any]:
        """Constructor arguments a module restored from a checkpoint takes from the checkpoint's hyperparameters
        (`hyper_parameters`) over its run's config: what the run read from files that need not exist where the
        checkpoint is loaded (another machine, a moved run), and that the checkpoint holds itself. Default none."""
        return {}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[MODEL_KEY] = class_path(self)
        if self.training_data:
            checkpoint[DATA_KEY] = self.training_data
        # Lightning calls this hook last, with everything the file will hold: the hyperparameters (config
        # nodes, a partial optimizer) and the callbacks' states become plain values, readable as data.
        for key, value in checkpoint.items():
            checkpoint[key] = plain(value)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A resumed run keeps the record of its first start; an older checkpoint has none.
        if checkpoint.get(DATA_KEY):
            self.training_data = checkpoint[DATA_KEY]
