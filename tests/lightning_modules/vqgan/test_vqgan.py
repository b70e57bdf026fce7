"""The VQ-GAN's method: codebook, losses, manual optimization with accumulation/clipping/AMP, metrics, images."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from lightning_modules.vqgan.codebook import EMACodebook
from lightning_modules.vqgan.vqgan import VQGAN, random_slices
from medvol.core.errors import MedvolError
from medvol.run.training import run
from tests.conftest import compose_cfg


def _epoch_metric(csv_path: Path, key: str) -> list[float]:
    rows = list(csv.DictReader(csv_path.open()))
    return [float(r[key]) for r in rows if r.get(key)]


def test_codebook_initialises_once_from_data_and_the_flag_is_saved():
    torch.manual_seed(0)
    codebook = EMACodebook(n_codes=16, embedding_dim=4)
    z = torch.randn(2, 4, 4, 4, 4) * 3 + 5
    assert not bool(codebook.initialized)
    codebook.train()(z)
    assert bool(codebook.initialized)
    # Initialised from encoder outputs: the codes sit where the data is, not at N(0, 1).
    assert codebook.embeddings.mean().item() == pytest.approx(5.0, abs=1.0)
    assert "initialized" in codebook.state_dict()

    restored = EMACodebook(n_codes=16, embedding_dim=4)
    restored.load_state_dict(codebook.state_dict())
    before = restored.embeddings.clone()
    restored.eval()(z)
    assert bool(restored.initialized)
    assert torch.equal(restored.embeddings, before)


def test_codebook_restarts_dead_codes_and_quantises_to_nearest():
    torch.manual_seed(0)
    codebook = EMACodebook(n_codes=8, embedding_dim=2, decay=0.5, restart_threshold=1.0).train()
    z = torch.tensor([[0.0, 0.0], [10.0, 10.0]]).repeat(32, 1).view(1, 2, 64, 1, 1).contiguous()
    z = z.view(1, 64, 2).permute(0, 2, 1).reshape(1, 2, 64, 1, 1)
    codebook(z)
    codebook.embeddings[:] = 100.0  # every code far from the data: all dead after a few updates
    for _ in range(5):
        out = codebook(z)
    # Dead codes were restarted onto encoder outputs, so the data is reconstructed exactly.
    assert torch.allclose(out.embeddings, z, atol=1e-4)
    assert (codebook.embeddings < 50).all()
    assert 1.0 <= out.perplexity.item() <= 2.0 + 1e-4


def test_straight_through_gradient_reaches_the_encoder_output():
    # Commitment weight 0: the straight-through value is the encoder output's only path to a gradient.
    codebook = EMACodebook(n_codes=4, embedding_dim=3, commitment_weight=0.0).train()
    z = torch.randn(1, 3, 2, 2, 2, requires_grad=True)
    out = codebook(z)
    (out.embeddings.sum() + out.commitment_loss).backward()
    # The decoder's gradient is copied onto the encoder output unchanged.
    assert z.grad is not None and torch.equal(z.grad, torch.ones_like(z))


def test_random_slices_picks_one_axial_slice_per_sample():
    volume = torch.arange(2 * 1 * 4 * 3 * 3, dtype=torch.float32).view(2, 1, 4, 3, 3)
    index = torch.tensor([1, 3])
    slices = random_slices(volume, index)
    assert slices.shape == (2, 1, 3, 3)
    assert torch.equal(slices[0], volume[0, :, 1])
    assert torch.equal(slices[1], volume[1, :, 3])


def test_vqgan_rejects_bad_settings_with_the_key_named():
    with pytest.raises(MedvolError, match="disc_loss_type"):
        VQGAN(disc_loss_type="wasserstein")
    with pytest.raises(MedvolError, match="perceptual_model_path"):
        VQGAN(perceptual_weight=0.1)
    with pytest.raises(MedvolError, match="perceptual_model_path"):
        VQGAN(perceptual_weight=0.1, perceptual_model_path="/no/such/net.pt")
    model = VQGAN(n_hiddens=8, n_codes=16, disc_channels=8, disc_layers=2)
    with pytest.raises(MedvolError, match="downsample"):
        model(torch.zeros(1, 1, 18, 16, 16))


def test_overfit_lowers_loss_and_raises_psnr(tiny_cfg, tmp_path):
    cfg = tiny_cfg(
        "logger=csv",
        "dataset.num_subjects=4",
        "dataset.val_fraction=0.25",
        "dataset.test_fraction=0",
        "trainer.max_epochs=14",
        "model.discriminator_iter_start=1000",
        "model.optimizer.lr=2e-3",
        "seed=3",
    )
    run(cfg)
    metrics = tmp_path / "csv" / "metrics.csv"
    psnr = _epoch_metric(metrics, "val/psnr")
    loss = _epoch_metric(metrics, "train/recon_loss_epoch")
    assert len(psnr) == 14 and len(loss) == 14
    assert loss[-1] < 0.6 * loss[0]
    assert psnr[-1] > psnr[0] + 2.0


def test_accumulation_steps_every_n_batches_and_discriminator_start_counts_batches(tiny_cfg):
    # 8 subjects, 1 val + 1 test -> 6 train subjects, batch 2 -> 3 batches per epoch; 2 epochs = batches 0..5.
    steps: list[int] = []
    handle = register_optimizer_step_post_hook(lambda opt, args, kwargs: steps.append(id(opt)))
    try:
        run(tiny_cfg("trainer.max_epochs=2", "trainer.accumulate_grad_batches=2", "model.discriminator_iter_start=2"))
    finally:
        handle.remove()
    autoencoder, discriminator = sorted(set(steps), key=steps.index)
    # Accumulating 2: a step after the 2nd batch of each epoch and after its last (3rd) batch.
    assert steps.count(autoencoder) == 4
    # Discriminators start at batch 2 (a count of batches, not of optimizer steps):
    # they step at the boundaries of batches 2, 4 and 5.
    assert steps.count(discriminator) == 3


def test_gradient_clipping_is_applied_after_unscaling_in_manual_optimization(tiny_cfg):
    norms: list[float] = []

    def record(optimizer, args, kwargs):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())

    # A post-hook: Lightning runs the clipping hook inside optimizer.step(closure), after pre-hooks.
    handle = register_optimizer_step_post_hook(record)
    try:
        run(tiny_cfg("trainer.gradient_clip_val=0.05", "trainer.precision=bf16-mixed"))
    finally:
        handle.remove()
    assert norms and max(norms) <= 0.05 * 1.01


def test_perceptual_loss_uses_a_local_torchscript_network(tiny_cfg, tmp_path):
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3, padding=1))
    path = tmp_path / "features.pt"
    torch.jit.save(torch.jit.script(net), str(path))
    metrics = run(tiny_cfg("model.perceptual_weight=0.5", f"model.perceptual_model_path={path}",
                           "trainer.fast_dev_run=true"))
    assert metrics["train/perceptual_loss_step"] > 0


def test_least_squares_discriminator_loss_is_the_squared_distance_to_the_target(tiny_cfg):
    model = VQGAN(n_hiddens=8, n_codes=16, disc_channels=8, disc_layers=2, disc_loss_type="least_squares")
    logits = torch.tensor([[0.5, -1.0, 2.0]])
    # MONAI's least-squares criterion puts the logits through a leaky ReLU (slope 0.05) first.
    activated = torch.nn.functional.leaky_relu(logits, 0.05)
    real, fake = ((activated - 1) ** 2).mean().item(), (activated**2).mean().item()
    assert model.adversarial.discriminator(logits, logits).item() == pytest.approx(0.5 * (real + fake))
    assert model.adversarial.generator(logits).item() == pytest.approx(real)
    metrics = run(tiny_cfg("model.disc_loss_type=least_squares", "model.discriminator_iter_start=0",
                           "trainer.fast_dev_run=true"))
    assert metrics["train/gan_discriminator_step"] > 0


def test_commitment_loss_pulls_the_encoder_output_towards_its_code():
    codebook = EMACodebook(n_codes=4, embedding_dim=3, commitment_weight=1.0).train()
    z = torch.randn(1, 3, 2, 2, 2, requires_grad=True)
    out = codebook(z)
    out.commitment_loss.backward()
    codes = out.embeddings.detach()  # the straight-through value equals the code in the forward pass
    assert torch.allclose(z.grad, 2 * (z.detach() - codes) / z.numel(), atol=1e-6)


def test_accumulating_two_batches_of_one_steps_like_one_batch_of_two(tmp_path):
    # A fixed codebook (decay 1, no restarts) and no discriminators: the step depends on the batch only.
    common = [
        "model._target_=tests.ddp_support.PreinitialisedVQGAN", "model.random_restart=false",
        "model.codebook_decay=1.0", "model.discriminator_iter_start=1000", "model.optimizer._target_=torch.optim.SGD",
        "~model.optimizer.betas", "model.optimizer.lr=0.5", "trainer.limit_val_batches=0",
        "callbacks.volume_slices=null",
    ]
    accumulated, single = tmp_path / "accumulated", tmp_path / "single"
    run(compose_cfg(accumulated, [*common, "dataset.batch_size=1", "trainer.accumulate_grad_batches=2",
                                  "trainer.limit_train_batches=2"]))
    run(compose_cfg(single, [*common, "dataset.batch_size=2", "trainer.limit_train_batches=1"]))
    first, second = (torch.load(d / "checkpoints" / "last.ckpt",
                                weights_only=True)["state_dict"] for d in (accumulated, single))
    for key in (k for k in first if k.startswith(("encoder.", "decoder."))):
        assert torch.allclose(first[key], second[key], rtol=1e-4, atol=1e-6), key
