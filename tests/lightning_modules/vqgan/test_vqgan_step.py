"""The VQ-GAN training step that runs each discriminator once per input gives the old step's losses, codes and
updates."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from monai.losses import PatchAdversarialLoss
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_modules.vqgan.adversarial import AdversarialLoss
from lightning_modules.vqgan.vqgan import _LOSS_TYPES, VQGAN, random_slices


def old_step(model: VQGAN, opt_ae, opt_disc, x: torch.Tensor, gan_on: bool) -> dict[str, torch.Tensor]:
    """The step as it was (commit 4a13182): MONAI's loss, discriminators frozen for the generator, four passes each."""
    hp = model.hparams
    adversarial = PatchAdversarialLoss(criterion=_LOSS_TYPES[hp.disc_loss_type], reduction="mean")
    discriminators = [*model.image_discriminator.parameters(), *model.video_discriminator.parameters()]
    autoencoder = [*model.encoder.parameters(), *model.decoder.parameters()]
    for p in discriminators:
        p.requires_grad_(False)
    x_rec, quantized = model(x)
    index = torch.randint(0, x.shape[2], (x.shape[0],), device=x.device)
    frames, frames_rec = random_slices(x, index), random_slices(x_rec, index)
    losses = {"recon_loss": F.l1_loss(x_rec, x) * hp.l1_weight}
    if gan_on:
        image_fake, video_fake = model.image_discriminator(frames_rec), model.video_discriminator(x_rec)
        losses["g_adv_loss"] = hp.image_gan_weight * adversarial(
            image_fake[-1], target_is_real=True, for_discriminator=False
        ) + hp.video_gan_weight * adversarial(video_fake[-1], target_is_real=True, for_discriminator=False)
        if hp.gan_feat_weight > 0:
            matching = x.new_zeros(())
            if hp.image_gan_weight > 0:
                matching = matching + model._feature_matching(image_fake, model.image_discriminator(frames))
            if hp.video_gan_weight > 0:
                matching = matching + model._feature_matching(video_fake, model.video_discriminator(x))
            losses["gan_feat_loss"] = hp.gan_feat_weight * matching
    losses["commitment_loss"] = quantized.commitment_loss
    ae_loss = torch.stack(list(losses.values())).sum()
    ae_loss.backward()
    opt_ae.step()
    opt_ae.zero_grad(set_to_none=True)
    for p in discriminators:
        p.requires_grad_(True)
    if gan_on:
        for p in autoencoder:
            p.requires_grad_(False)

        def d_loss(disc, real, fake):
            real_loss = adversarial(disc(real.detach())[-1], target_is_real=True, for_discriminator=True)
            fake_loss = adversarial(disc(fake.detach())[-1], target_is_real=False, for_discriminator=True)
            return 0.5 * (real_loss + fake_loss)

        disc_loss = hp.image_gan_weight * d_loss(model.image_discriminator, frames, frames_rec) + (
            hp.video_gan_weight * d_loss(model.video_discriminator, x, x_rec)
        )
        disc_loss.backward()
        opt_disc.step()
        opt_disc.zero_grad(set_to_none=True)
        for p in autoencoder:
            p.requires_grad_(True)
        losses["disc_loss"] = disc_loss
    out = {k: v.detach() for k, v in losses.items()}
    out["generator_loss"] = ae_loss.detach()
    out["codes"] = quantized.encodings
    return out


def new_step(model: VQGAN, opt_ae, opt_disc, x: torch.Tensor, gan_on: bool) -> dict[str, torch.Tensor]:
    """The step as `VQGAN.training_step` takes it, without Lightning: the discriminators' update first (their weights'
    gradients alone), then the generator's."""
    step = model.gan_losses(x, gan_on)
    out = {k: v.detach() for k, v in step.terms.items()}
    if step.discriminator_loss is not None:
        step.discriminator_loss.backward(inputs=model.discriminator_parameters())
        opt_disc.step()
        opt_disc.zero_grad(set_to_none=True)
        out["disc_loss"] = step.discriminator_loss.detach()
    step.generator_objective.backward()
    opt_ae.step()
    opt_ae.zero_grad(set_to_none=True)
    out["generator_loss"] = step.generator_loss
    out["codes"] = step.quantized.encodings
    return out


def tiny_vqgan(**kwargs) -> VQGAN:
    torch.manual_seed(0)
    settings = dict(n_hiddens=8, n_codes=32, disc_channels=8, disc_layers=2, l1_weight=4.0, gan_feat_weight=4.0)
    return VQGAN(**{**settings, **kwargs}).train()


def volumes(batch: int = 2, size: int = 16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    grid = torch.linspace(-1, 1, size)
    ball = (grid.view(-1, 1, 1) ** 2 + grid.view(1, -1, 1) ** 2 + grid.view(1, 1, -1) ** 2 < 0.5).float()
    return (ball * 1.2 - 0.6 + 0.3 * torch.rand(batch, 1, size, size, size, generator=generator)).clamp(-1, 1)


def run_steps(step, model: VQGAN, x: torch.Tensor, schedule: list[bool]) -> list[dict[str, torch.Tensor]]:
    opt_ae, opt_disc = model.configure_optimizers()
    records = []
    for i, gan_on in enumerate(schedule):
        torch.manual_seed(100 + i)  # codebook initialisation and restarts, slice choice
        records.append(step(model, opt_ae, opt_disc, x, gan_on))
    return records


@pytest.mark.parametrize("loss_type", ["hinge", "least_squares", "vanilla"])
def test_step_gives_the_old_steps_losses_codes_and_weights(loss_type):
    # Warm-up batch (generator only), then four GAN batches; both models start from the same weights and RNG.
    model = tiny_vqgan(disc_loss_type=loss_type)
    reference = copy.deepcopy(model)
    x = volumes()
    schedule = [False, True, True, True, True]
    new, old = run_steps(new_step, model, x, schedule), run_steps(old_step, reference, x, schedule)
    for i, (n, o) in enumerate(zip(new, old, strict=True)):
        assert n.keys() == o.keys()
        assert torch.equal(n["codes"], o["codes"]), f"batch {i}: codes differ"
        for name in n.keys() - {"codes"}:
            if i < 2:
                # Same weights, same forward passes: the same numbers, bit for bit.
                assert torch.equal(n[name], o[name]), f"batch {i}: {name}"
            else:
                # After an update: the autoencoder's gradient sums its contributions in another order (float32
                # addition is not associative), a few ulps per element, so losses agree to float32 rounding.
                torch.testing.assert_close(n[name], o[name], rtol=1e-5, atol=1e-6, msg=f"batch {i}: {name}")
    # The reconstruction (the autoencoder's conv biases that a group norm follows get no gradient but
    # rounding noise, which Adam scales up to lr-sized moves; the norm cancels them) and the discriminators'
    # weights. Their batch-norm running statistics are updated once per pass, so they differ; nothing reads
    # them (the discriminators only ever run in training mode).
    model.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], reference(x)[0], rtol=1e-4, atol=1e-5)
    weights = dict(reference.named_parameters())
    for name, weight in model.named_parameters():
        if "discriminator" in name:
            torch.testing.assert_close(weight, weights[name], rtol=1e-4, atol=1e-6, msg=name)


def test_step_in_bf16_autocast_gives_the_old_steps_losses_and_codes_and_in_float32_its_gradients():
    # Under bf16 autocast the forward passes must be the old step's, the same operations in the same precision:
    # losses and codes equal bit for bit. The gradients are compared in float32. In bf16 they depend on the machine,
    # not on the step: its kernels and thread count (torch 2.13's CPU bf16 convolution backward gave the video
    # discriminator's last layer gradients near 1e20 at one thread, to both steps; the 2026-11-27 GPU round's
    # 16-core host put decoder.up.7.bias 0.0099 apart, here 2 threads 0.0009). In float32 the two steps sum the same
    # contributions in another order: equal to float32 rounding, a bound of 2^10 float32 epsilons of the gradients'
    # scale (about 10 of them were seen at 1, 2 and 16 threads).
    x = volumes()

    def gradients(step, model: VQGAN, bf16: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        grads: dict[str, torch.Tensor] = {}

        class Capture:
            def step(self) -> None:
                grads.update({k: p.grad.clone() for k,
                              p in model.named_parameters() if p.grad is not None and k not in grads})

            def zero_grad(self, set_to_none: bool = True) -> None:
                model.zero_grad(set_to_none=set_to_none)

        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = step(model, Capture(), Capture(), x, True)
        return grads, out

    model = tiny_vqgan()
    (_, new_out), (_, old_out) = (gradients(step, copy.deepcopy(model), True) for step in (new_step, old_step))
    assert new_out.keys() == old_out.keys()
    for name in old_out:
        assert torch.equal(new_out[name], old_out[name]), name
    (new, _), (old, _) = (gradients(step, copy.deepcopy(model), False) for step in (new_step, old_step))
    assert new.keys() == old.keys()
    rounding = 2**10 * torch.finfo(torch.float32).eps
    scale = max(g.abs().max() for g in old.values())
    largest = max(g.norm() for g in old.values())
    for name, gradient in old.items():
        torch.testing.assert_close(new[name], gradient, rtol=0, atol=float(rounding * scale), msg=name)
        if gradient.norm() > 1e-3 * largest:  # not the conv biases a group norm follows: theirs is rounding noise
            assert (new[name] - gradient).norm() <= rounding * gradient.norm(), name


@pytest.mark.parametrize("criterion", ["hinge", "least_squares", "bce"])
@pytest.mark.parametrize("bf16", [False, True])
def test_adversarial_loss_is_monais_patch_adversarial_loss(criterion, bf16):
    patch_loss = PatchAdversarialLoss(criterion=criterion, reduction="mean")

    def monai(logits: torch.Tensor, **kwargs) -> torch.Tensor:
        if criterion != "bce":
            return patch_loss(logits, **kwargs)
        # Ours computes the cross-entropy in float32 (CUDA autocast refuses it in bf16): MONAI's in float32.
        with torch.autocast("cpu", enabled=False):
            return patch_loss(logits.float(), **kwargs)

    ours = AdversarialLoss(criterion)
    torch.manual_seed(0)
    real, fake = torch.randn(2, 1, 3, 3, 3) * 2, torch.randn(2, 1, 3, 3, 3) * 2

    def both(fn_ours, fn_monai):
        values = []
        for fn in (fn_ours, fn_monai):
            r, f = real.clone().requires_grad_(), fake.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                value = fn(r.to(torch.bfloat16) if bf16 else r, f.to(torch.bfloat16) if bf16 else f)
            value.backward()
            values.append((value.float(), r.grad, f.grad))
        return values

    generator = both(lambda r, f: ours.generator(f), lambda r,
                     f: monai(f, target_is_real=True, for_discriminator=False))
    discriminator = both(
        ours.discriminator,
        lambda r, f: 0.5 * (monai(r, target_is_real=True, for_discriminator=True)
                            + monai(f, target_is_real=False, for_discriminator=True)),
    )
    for (value, *grads), (expected, *expected_grads) in (generator, discriminator):
        torch.testing.assert_close(value, expected, rtol=1e-6 if not bf16 else 1e-2, atol=1e-7)
        for g, e in zip(grads, expected_grads, strict=True):
            if e is not None:
                torch.testing.assert_close(g.float(), e.float(), rtol=1e-6 if not bf16 else 1e-2, atol=1e-7)


def test_gradient_through_the_discriminators_is_unscaled_after_the_loss_scale():
    # Lightning's manual_backward multiplies the objective by the scaler's scale; the gradient taken through
    # the discriminators inside `gan_losses` is scaled and unscaled by the same power of two: exact in float32.
    x = volumes()
    model = tiny_vqgan()
    scaled = copy.deepcopy(model)
    scale = torch.tensor(2.0**16)
    for m, loss_scale in ((model, None), (scaled, scale)):
        torch.manual_seed(3)
        step = m.gan_losses(x, True, loss_scale)
        (step.generator_objective * (1.0 if loss_scale is None else loss_scale)).backward()
    weights = dict(scaled.named_parameters())
    for name, weight in model.named_parameters():
        if weight.grad is not None:
            assert torch.equal(weights[name].grad / scale, weight.grad), name


class HostRoundTrips(TorchDispatchMode):
    """Records the ops that, on a GPU, make the host wait for the device: a tensor read into Python
    (`item`, `bool`), a tensor made from Python data (copied to the device), CUDA's bincount and nonzero."""

    WAITS = ("aten._local_scalar_dense", "aten.lift_fresh", "aten.bincount", "aten.nonzero")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.WAITS):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("loss_type", ["hinge", "least_squares", "vanilla"])
def test_losses_and_backward_passes_never_wait_for_the_device(loss_type):
    model = tiny_vqgan(disc_loss_type=loss_type)
    x = volumes()
    model.gan_losses(x, True)  # the first batch initialises the codebook (one read of its flag)
    with HostRoundTrips() as trips:
        step = model.gan_losses(x, True)
        step.generator_objective.backward()
        step.discriminator_loss.backward()
    assert trips.seen == []


def test_gpu_speedups_apply_on_a_cuda_device_only_and_keep_the_checkpoint_names():
    model = tiny_vqgan(compile=True, channels_last=True)
    names = list(model.state_dict())
    model.accelerate(torch.device("cpu"))
    assert model._memory_format == torch.contiguous_format and model.encoder._compiled_call_impl is None
    x = volumes()
    model.eval()
    with torch.no_grad():
        eager = model(x)[0]
    # The layout and the wrappers are set up without a GPU; nothing below runs a compiled network.
    model.accelerate(torch.device("cuda"))
    assert list(model.state_dict()) == names
    for network in (model.encoder, model.decoder, model.image_discriminator, model.video_discriminator):
        assert network._compiled_call_impl is not None
    for network in (model.encoder, model.decoder, model.video_discriminator):
        for weight in network.parameters():
            if weight.dim() == 5:
                assert weight.is_contiguous(memory_format=torch.channels_last_3d)
    # The 2D slice discriminator keeps the default layout (its inputs are single slices).
    assert all(w.is_contiguous() for w in model.image_discriminator.parameters())
    model.encoder._compiled_call_impl = model.decoder._compiled_call_impl = None
    with torch.no_grad():
        # Same arithmetic in another memory order: float32 summation order only.
        torch.testing.assert_close(model(x)[0], eager, rtol=1e-5, atol=1e-5)


def test_the_training_step_updates_the_discriminators_first_from_their_weights_gradients_alone(monkeypatch, tmp_path):
    from torch.utils.data import DataLoader

    from tests.tiny_trainer import tiny_trainer

    backward_passes: list[list[torch.nn.Parameter] | None] = []
    original = VQGAN.manual_backward

    def recording(self, loss, *args, **kwargs):  # noqa: ANN001, ANN202 - Lightning's signature
        backward_passes.append(kwargs.get("inputs"))
        return original(self, loss, *args, **kwargs)

    monkeypatch.setattr(VQGAN, "manual_backward", recording)
    model = tiny_vqgan(discriminator_iter_start=0)
    data = DataLoader([{"image": volume} for volume in volumes()], batch_size=2)
    tiny_trainer(tmp_path, max_steps=1).fit(model, data)
    # The discriminators' backward pass first (their graphs freed before the autoencoder's pass), computing gradients
    # for their weights alone (none for the reconstruction's detached copy they judged), then the generator's.
    assert len(backward_passes) == 2 and backward_passes[1] is None
    assert [id(p) for p in backward_passes[0]] == [id(p) for p in model.discriminator_parameters()]
