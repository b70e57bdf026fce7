"""The diffusion core shared by Fast-DDPM and X-ray-to-CT: timestep sets, algebra, samplers, fp32 tables, EMA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_modules.diffusion.checkpointing import checkpoint_blocks, unet_blocks
from lightning_modules.diffusion.ema import EMA
from lightning_modules.diffusion.prediction import PREDICTION_TYPES, to_x0_and_epsilon, training_target
from lightning_modules.diffusion.samplers import ddim_step, ddpm_posterior, sample_ddim
from lightning_modules.diffusion.schedule import NoiseSchedule
from lightning_modules.diffusion.timesteps import (
    PAPER_NON_UNIFORM_10,
    antithetic_indices,
    non_uniform_set,
    timestep_set,
    uniform_set,
)
from medvol.core.errors import MedvolError


def test_non_uniform_set_for_ten_steps_is_the_papers():
    assert timestep_set(10, "non_uniform").tolist() == [0, 199, 399, 599, 699, 799, 849, 899, 949, 999]
    assert list(PAPER_NON_UNIFORM_10) == timestep_set(10, "non_uniform").tolist()


@pytest.mark.parametrize("count", [1, 2, 5, 7, 10, 20, 50, 100, 300])
@pytest.mark.parametrize("spacing", ["uniform", "non_uniform"])
def test_every_set_has_exactly_T_sorted_distinct_steps_in_range(count, spacing):
    steps = timestep_set(count, spacing).tolist()
    assert len(steps) == count
    assert steps == sorted(set(steps))
    assert 0 <= steps[0] and steps[-1] <= 999


def test_uniform_set_keeps_both_ends_and_non_uniform_puts_60_percent_above_699():
    # The reference's arange(-1, 1000, 100) with the first entry set to 0 has 11 entries; ours has 10.
    assert uniform_set(10) == [0, 111, 222, 333, 444, 555, 666, 777, 888, 999]
    assert uniform_set(1000) == list(range(1000))
    steps = non_uniform_set(20)
    assert sum(s < 699 for s in steps) == 8 and sum(s >= 699 for s in steps) == 12
    assert steps[0] == 0 and steps[-1] == 999


@pytest.mark.parametrize(
    ("value", "words"),
    [([], "is empty"), ([5, 3], "not sorted"), ([3, 3, 9], "repeats"), ([0, 1000], "leaves [0, 1000)"), ([-1, 4], "leaves")],
)
def test_bad_explicit_sets_raise_one_line_naming_the_key(value, words):
    with pytest.raises(MedvolError, match="`model.timesteps`") as err:
        timestep_set(value)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_set_sizes_and_spacing_are_checked():
    with pytest.raises(MedvolError, match="must be in"):
        timestep_set(0)
    with pytest.raises(MedvolError, match="timestep_spacing"):
        timestep_set(10, "log")
    # 600 steps in [699, 999] cannot be distinct: refused rather than silently repeated.
    with pytest.raises(MedvolError, match="repeats"):
        timestep_set(1000, "non_uniform")


def test_antithetic_indices_pair_i_with_T_minus_1_minus_i():
    index = antithetic_indices(8, 10, torch.Generator().manual_seed(0))
    assert torch.equal(index[:4] + index[4:], torch.full((4,), 9))
    assert antithetic_indices(3, 10).shape == (3,)


@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize("prediction", PREDICTION_TYPES)
def test_noising_target_and_recovery_round_trip(kind, prediction):
    schedule = NoiseSchedule(kind)
    torch.manual_seed(0)
    x0, noise = torch.randn(4, 2, 4, 4, 4), torch.randn(4, 2, 4, 4, 4)
    t = torch.tensor([0, 10, 500, 999])
    x_t = schedule.add_noise(x0, noise, t)
    a = schedule.alpha_bar(t).view(-1, 1, 1, 1, 1)
    assert torch.allclose(x_t, a.sqrt() * x0 + (1 - a).sqrt() * noise)
    # In fp64 the algebra is exact; in fp32, recovering x0 from epsilon divides by sqrt(alpha_bar) ~ 1e-4 at t = 999.
    x0, noise, a = x0.double(), noise.double(), schedule.alpha_bar(t).double()
    x_t = a.view(-1, 1, 1, 1, 1).sqrt() * x0 + (1 - a.view(-1, 1, 1, 1, 1)).sqrt() * noise
    target = training_target(prediction, x0, noise, a)
    x0_back, eps_back = to_x0_and_epsilon(prediction, target, x_t, a)
    assert torch.allclose(x0_back, x0, rtol=0, atol=1e-9)
    assert torch.allclose(eps_back, noise, rtol=0, atol=1e-9)


def test_linear_schedule_is_the_ddpm_one():
    schedule = NoiseSchedule("linear")
    assert schedule.betas[0].item() == pytest.approx(1e-4) and schedule.betas[-1].item() == pytest.approx(0.02)
    assert schedule.alphas_cumprod[-1].item() == pytest.approx(4.04e-5, rel=0.01)
    assert schedule.alpha_bar(torch.tensor([-1])).item() == 1.0


def test_noise_tables_stay_fp32_under_bf16():
    schedule = NoiseSchedule("linear")
    reference = schedule.alphas_cumprod.clone()
    schedule.to(torch.bfloat16)
    schedule.half()
    assert schedule.betas.dtype == torch.float32 and schedule.alphas_cumprod.dtype == torch.float32
    assert torch.equal(schedule.alphas_cumprod, reference)
    x0 = torch.randn(2, 1, 4, 4, 4, dtype=torch.bfloat16)
    noise = torch.randn(2, 1, 4, 4, 4, dtype=torch.bfloat16)
    t = torch.tensor([998, 999])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x_t = schedule.add_noise(x0, noise, t)
    assert x_t.dtype == torch.float32
    a = reference[t].view(-1, 1, 1, 1, 1)
    assert torch.equal(x_t, a.sqrt() * x0.float() + (1 - a).sqrt() * noise.float())


def _consistent(schedule: NoiseSchedule, t: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(t)
    x0, eps = torch.randn(2, 1, 4, 4, 4), torch.randn(2, 1, 4, 4, 4)
    t_batch = torch.full((2,), t)
    return x0, eps, schedule.add_noise(x0, eps, t_batch), t_batch


@pytest.mark.parametrize("t", [1, 50, 500, 999])
def test_ddim_with_eta_one_and_stride_one_is_the_ddpm_posterior(t):
    schedule = NoiseSchedule("linear")
    x0, eps, x_t, t_batch = _consistent(schedule, t)
    # In fp64, so the comparison is of the formulas, not of fp32 cancellation near t = 0.
    a_t, a_prev = schedule.alpha_bar(t_batch).double(), schedule.alpha_bar(t_batch - 1).double()
    x0, eps = x0.double(), eps.double()
    x_t = a_t.sqrt().view(-1, 1, 1, 1, 1) * x0 + (1 - a_t).sqrt().view(-1, 1, 1, 1, 1) * eps
    mean, variance = ddpm_posterior(x0, x_t, a_t, a_prev)
    ddim_mean = ddim_step(x0, eps, a_t, a_prev, eta=1.0, noise=torch.zeros_like(x0))
    assert torch.allclose(ddim_mean, mean, rtol=0, atol=1e-10)
    unit = torch.ones_like(x0)
    sigma = ddim_step(x0, eps, a_t, a_prev, eta=1.0, noise=unit) - ddim_mean
    assert torch.allclose(sigma**2, variance.expand_as(sigma), rtol=1e-8, atol=0)
    # The DDPM variance is beta_t (1 - alpha_bar_{t-1}) / (1 - alpha_bar_t).
    beta = schedule.betas[t]
    expected = beta * (1 - schedule.alphas_cumprod[t - 1]) / (1 - schedule.alphas_cumprod[t])
    assert variance.flatten()[0].item() == pytest.approx(expected.item(), rel=1e-3)


def test_ddim_with_eta_zero_is_deterministic_and_ends_at_alpha_bar_one():
    schedule = NoiseSchedule("linear")
    steps = timestep_set(10)
    seen: list[int] = []
    target = torch.full((1, 1, 4, 4, 4), 0.5)

    def denoise(x_t: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(int(t[0]))
        a = schedule.alpha_bar(t).view(-1, 1, 1, 1, 1)
        return target, (x_t - a.sqrt() * target) / (1 - a).sqrt()

    x_T = torch.randn(1, 1, 4, 4, 4)
    first = sample_ddim(denoise, x_T, schedule, steps, eta=0.0, noise_like=lambda x: torch.randn_like(x))
    second = sample_ddim(denoise, x_T, schedule, steps, eta=0.0, noise_like=lambda x: torch.randn_like(x))
    assert torch.equal(first, second)
    assert seen[:10] == list(reversed(steps.tolist()))
    # The last update goes to alpha_bar = 1, i.e. returns the predicted clean volume itself.
    assert torch.allclose(first, target, atol=1e-5)
    noisy = sample_ddim(denoise, x_T, schedule, steps, eta=1.0, noise_like=lambda x: torch.randn_like(x))
    assert torch.allclose(noisy, target, atol=1e-5)


def test_ema_follows_the_decay_and_copies_buffers():
    network = nn.BatchNorm1d(3)
    ema = EMA(network, decay=0.9)
    with torch.no_grad():
        network.weight.fill_(2.0)
        network.running_mean.fill_(5.0)
    ema.update(network)
    assert torch.allclose(ema.module.weight, torch.full((3,), 0.9 * 1.0 + 0.1 * 2.0))
    assert torch.equal(ema.module.running_mean, network.running_mean)
    assert int(ema.updates) == 1 and not ema.module.training
    warm = EMA(network, decay=0.999, warmup=True)
    assert warm.current_decay() == pytest.approx(0.1)


def test_activation_checkpointing_keeps_names_outputs_and_gradients():
    from monai.networks.nets import DiffusionModelUNet

    torch.manual_seed(0)
    plain = DiffusionModelUNet(
        spatial_dims=3, in_channels=2, out_channels=1, channels=(8, 8), attention_levels=(False, True),
        num_res_blocks=1, norm_num_groups=4, num_head_channels=4,
    )
    wrapped = DiffusionModelUNet(
        spatial_dims=3, in_channels=2, out_channels=1, channels=(8, 8), attention_levels=(False, True),
        num_res_blocks=1, norm_num_groups=4, num_head_channels=4,
    )
    wrapped.load_state_dict(plain.state_dict())
    checkpoint_blocks(unet_blocks(wrapped))
    assert len(unet_blocks(wrapped)) == 5
    assert plain.state_dict().keys() == wrapped.state_dict().keys()
    x, t = torch.randn(1, 2, 8, 8, 8), torch.tensor([10])
    calls = []
    next(wrapped.middle_block.children()).register_forward_hook(lambda *args: calls.append(1))
    plain(x, t).square().sum().backward()
    wrapped(x, t).square().sum().backward()
    # Checkpointing runs the middle block again in the backward pass.
    assert len(calls) == 2
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-5), name
