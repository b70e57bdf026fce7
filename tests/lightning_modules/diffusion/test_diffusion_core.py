"""The diffusion core shared by Fast-DDPM and X-ray-to-CT: timestep sets, algebra, samplers, fp32 tables, EMA."""

from __future__ import annotations

import copy
import math
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from monai.networks.schedulers import DDPMScheduler
from torch import nn

from lightning_modules.diffusion.checkpointing import checkpoint_unet
from lightning_modules.diffusion.ema import EMA
from lightning_modules.diffusion.prediction import PREDICTION_TYPES, to_x0_and_epsilon, training_target
from lightning_modules.diffusion.samplers import ddim_step, ddpm_posterior, sample_ddim, sample_ddpm
from lightning_modules.diffusion.schedule import NoiseSchedule
from lightning_modules.diffusion.timesteps import (
    PAPER_NON_UNIFORM_10,
    antithetic_indices,
    non_uniform_set,
    timestep_set,
    uniform_set,
)
from medvol.core.errors import MedvolError
from tests.lightning_modules.diffusion.test_windowed_sampling import _fast_ddpm


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
    [([], "is empty"), ([5, 3], "not sorted"), ([3, 3, 9], "repeats"), ([0, 1000], "leaves [0, 1000)"),
     ([-1, 4], "leaves")],
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


def saved_values(network: nn.Module, *inputs: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """(values autograd keeps for the backward pass of `network(*inputs)`, the parameters' gradients)."""
    sizes: list[int] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        loss = network(*inputs).square().sum()
    return sum(sizes), list(torch.autograd.grad(loss, list(network.parameters())))


def test_activation_checkpointing_recomputes_each_block_with_the_same_names_and_gradients():
    from monai.networks.nets import DiffusionModelUNet

    settings = {"spatial_dims": 3, "in_channels": 2, "out_channels": 1, "channels": (8, 8),
                "attention_levels": (False, True), "num_res_blocks": 1, "norm_num_groups": 4, "num_head_channels": 4}
    torch.manual_seed(0)
    plain = DiffusionModelUNet(**settings)
    for weight in plain.parameters():
        if not weight.any():  # MONAI zeroes the output convolutions: gradients would not reach the blocks before
            torch.nn.init.normal_(weight, std=0.1)
    wrapped = DiffusionModelUNet(**settings)
    wrapped.load_state_dict(plain.state_dict())
    # Counted by hand: residual blocks 1 + 1 down, 2 middle, 2 + 2 up; attention 1 down, 1 middle, 2 up.
    assert checkpoint_unet(wrapped) == 12
    assert plain.state_dict().keys() == wrapped.state_dict().keys()
    x, t = torch.randn(1, 2, 8, 8, 8), torch.tensor([10])
    calls = []
    # A residual block of the full-resolution up block runs again in the backward pass; the blocks are checkpointed
    # one by one, never a whole down or up block at once.
    wrapped.up_blocks[-1].resnets[-1].conv1.register_forward_hook(lambda *args: calls.append("block"))
    assert not any(type(b).__name__.startswith("Checkpointed") for b in [*wrapped.down_blocks, *wrapped.up_blocks])
    kept_plain, plain_gradients = saved_values(plain, x, t)
    kept_wrapped, wrapped_gradients = saved_values(wrapped, x, t)
    assert calls == ["block", "block"]
    assert kept_wrapped < kept_plain / 2
    for (name, _), a, b in zip(plain.named_parameters(), plain_gradients, wrapped_gradients, strict=True):
        torch.testing.assert_close(b, a, msg=name)
    # Without gradients (sampling) and in eval mode (the EMA copy) nothing is recomputed.
    calls.clear()
    with torch.no_grad():
        wrapped(x, t)
    wrapped.eval()
    wrapped(x, t).sum().backward()
    assert calls == ["block", "block"]


@pytest.mark.parametrize("model", ["ddpm", "ldm", "xray2ct"])
def test_the_denoisers_attend_fused_by_default_and_equal_monais_explicit_attention(model, tmp_path):
    from hydra.utils import instantiate
    from monai.networks.blocks import CrossAttentionBlock, SABlock

    from tests.conftest import compose_cfg

    cfg = compose_cfg(tmp_path, [f"model={model}"], tiny=False)
    settings = dict(cfg.model.network) if model != "xray2ct" else {}
    if model == "xray2ct":
        from lightning_modules.xray2ct.denoiser import ViewConditionedDenoiser, network_settings

        settings = network_settings(cfg.model)
        assert settings["use_flash_attention"] is True
        torch.manual_seed(0)
        settings.update(num_views=2, xray_size=(16, 16))
        fused = ViewConditionedDenoiser(**settings)
        explicit = ViewConditionedDenoiser(**{**settings, "use_flash_attention": False})
        inputs = (torch.randn(2, 1, 16, 16, 16), torch.tensor([3, 700]), torch.rand(2, 2, 16, 16))
    else:
        assert settings["use_flash_attention"] is True
        torch.manual_seed(0)
        fused = instantiate(cfg.model.network)(in_channels=2, out_channels=1)
        explicit = instantiate(cfg.model.network, use_flash_attention=False)(in_channels=2, out_channels=1)
        inputs = (torch.randn(2, 2, 16, 16, 16), torch.tensor([3, 700]))
    attention = [m for m in fused.modules() if isinstance(m, (SABlock, CrossAttentionBlock))]
    assert attention and all(m.use_flash_attention for m in attention)
    # One set of weights serves both: the same state-dict keys, each network's checkpoint loads in the other.
    for weight in fused.parameters():
        if not weight.any():  # MONAI zeroes the output convolutions: an all-zero output would compare nothing
            torch.nn.init.normal_(weight, std=0.1)
    assert fused.state_dict().keys() == explicit.state_dict().keys()
    explicit.load_state_dict(fused.state_dict())
    fused.load_state_dict(explicit.state_dict())
    outputs, gradients = [], []
    for network in (fused, explicit):
        output = network(*inputs)
        outputs.append(output.detach())
        gradients.append(torch.autograd.grad(output.square().sum(), list(network.parameters())))
    assert outputs[0].abs().max() > 0.1
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)
    # Float sums over every voxel in another order: equal to a thousandth of the gradients' scale.
    scale = max(float(gradient.abs().max()) for gradient in gradients[1])
    for fused_gradient, explicit_gradient in zip(*gradients, strict=True):
        torch.testing.assert_close(fused_gradient, explicit_gradient, rtol=1e-3, atol=1e-3 * scale)


def test_schedules_equal_monais_and_the_v_target_is_monais_velocity():
    torch.manual_seed(0)
    x0, noise, t = torch.randn(3, 1, 4, 4, 4), torch.randn(3, 1, 4, 4, 4), torch.tensor([0, 400, 999])
    for kind, monai_kind in (("linear", "linear_beta"), ("cosine", "cosine")):
        ours, monai = NoiseSchedule(kind), DDPMScheduler(1000, schedule=monai_kind)
        torch.testing.assert_close(ours.alphas_cumprod, monai.alphas_cumprod.float(), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(ours.add_noise(x0, noise, t), monai.add_noise(x0, noise, t), rtol=1e-4, atol=1e-5)
        target = training_target("v", x0, noise, ours.alpha_bar(t))
        torch.testing.assert_close(target, monai.get_velocity(x0, noise, t), rtol=1e-4, atol=1e-5)


def _hand_alpha_bar() -> np.ndarray:
    """alpha_bar_t of Ho et al.'s linear schedule (beta from 1e-4 to 0.02 over 1000 steps), in fp64."""
    return np.cumprod(1.0 - np.linspace(1e-4, 0.02, 1000))


def _biased_epsilon(x_t: torch.Tensor, t: int) -> torch.Tensor:
    """An imperfect denoiser: linear in x_t, biased, depending on the step."""
    return 0.8 * x_t + 0.1 - t / 5000


@pytest.mark.parametrize("eta", [0.0, 0.6])
@pytest.mark.parametrize("steps", [list(PAPER_NON_UNIFORM_10), [3, 40, 41, 500, 999]], ids=["paper", "uneven"])
def test_ddim_walk_of_a_biased_denoiser_equals_the_papers_update_written_out(steps, eta):
    schedule, alpha_bar = NoiseSchedule("linear"), _hand_alpha_bar()
    torch.manual_seed(0)
    x_T = torch.randn(2, 1, 4, 4, 4)
    noises = [torch.randn(2, 1, 4, 4, 4) for _ in steps]

    def denoise(x_t: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = float(alpha_bar[int(t[0])])
        eps = _biased_epsilon(x_t.double(), int(t[0]))
        return (x_t.double() - math.sqrt(1 - a) * eps) / math.sqrt(a), eps

    drawn = iter(noises)
    walked = sample_ddim(denoise, x_T, schedule, torch.tensor(steps), eta, lambda x: next(drawn))

    # Song et al. 2021, eq. 12, from each step of the set to the one below it, the last to alpha_bar = 1:
    # x_prev = sqrt(a_prev) x0_pred + sqrt(1 - a_prev - sigma^2) eps + sigma z,
    # sigma = eta sqrt((1 - a_prev) / (1 - a_t)) sqrt(1 - a_t / a_prev),
    # x0_pred = (x_t - sqrt(1 - a_t) eps) / sqrt(a_t).
    x = x_T.double()
    for k, i in enumerate(reversed(range(len(steps)))):
        a_t = float(alpha_bar[steps[i]])
        a_prev = float(alpha_bar[steps[i - 1]]) if i > 0 else 1.0
        eps = _biased_epsilon(x, steps[i])
        x0_pred = (x - math.sqrt(1 - a_t) * eps) / math.sqrt(a_t)
        sigma = eta * math.sqrt((1 - a_prev) / (1 - a_t)) * math.sqrt(1 - a_t / a_prev)
        x = math.sqrt(a_prev) * x0_pred + math.sqrt(1 - a_prev - sigma**2) * eps + sigma * noises[k].double()
    torch.testing.assert_close(walked.double(), x, rtol=1e-4, atol=1e-4)


def test_ddpm_ancestral_walk_of_a_biased_denoiser_equals_hos_posterior_written_out():
    schedule = NoiseSchedule("linear", num_train_timesteps=6, beta_start=0.05, beta_end=0.4)
    betas = np.linspace(0.05, 0.4, 6)
    alpha_bar = np.cumprod(1 - betas)
    torch.manual_seed(0)
    x_T = torch.randn(2, 1, 4, 4, 4, dtype=torch.float64)
    noises = [torch.randn(2, 1, 4, 4, 4, dtype=torch.float64) for _ in range(5)]

    def denoise(x_t: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return 0.5 * x_t.double() + 0.1, torch.zeros_like(x_t)

    drawn = iter(noises)
    walked = sample_ddpm(denoise, x_T, schedule, lambda x: next(drawn))
    # Ho et al. 2020, eqs. 6-7:
    # mean = sqrt(a_prev) beta_t / (1 - a_t) x0 + sqrt(1 - beta_t) (1 - a_prev) / (1 - a_t) x_t,
    # variance = (1 - a_prev) / (1 - a_t) beta_t, no noise added at t = 0.
    x = x_T
    for k, t in enumerate(range(5, -1, -1)):
        a_t, a_prev, beta = alpha_bar[t], alpha_bar[t - 1] if t > 0 else 1.0, betas[t]
        x0 = 0.5 * x + 0.1
        mean = math.sqrt(a_prev) * beta / (1 - a_t) * x0 + math.sqrt(1 - beta) * (1 - a_prev) / (1 - a_t) * x
        x = mean + math.sqrt((1 - a_prev) / (1 - a_t) * beta) * noises[k] if t > 0 else mean
    torch.testing.assert_close(walked.double(), x, rtol=1e-5, atol=1e-5)


def test_clip_sample_clamps_each_predicted_x0_and_recomputes_its_epsilon():
    plain, clipped = _fast_ddpm(), _fast_ddpm(clip_sample=True)
    for module in (plain, clipped):
        with torch.no_grad():
            module.network.conv.weight.mul_(20)
    torch.manual_seed(1)
    x_t, cond, t = torch.randn(2, 1, 6, 6, 6), torch.randn(2, 1, 6, 6, 6), torch.tensor([999, 10])
    x0, _ = plain.denoiser_for(plain.network, plain.conditioning(cond))(x_t, t)
    assert (x0.abs() > 1).float().mean() > 0.2
    x0_clipped, eps = clipped.denoiser_for(clipped.network, clipped.conditioning(cond))(x_t, t)
    assert torch.equal(x0_clipped, x0.clamp(-1, 1))
    a = torch.tensor(_hand_alpha_bar()[[999, 10]], dtype=torch.float32).view(-1, 1, 1, 1, 1)
    torch.testing.assert_close(eps, (x_t - a.sqrt() * x0_clipped) / (1 - a).sqrt(), rtol=1e-5, atol=1e-5)


def test_loss_reductions_are_the_voxel_mean_and_the_per_sample_voxel_sum_averaged_over_the_batch():
    torch.manual_seed(0)
    output, target = torch.randn(2, 1, 4, 4, 4), torch.randn(2, 1, 4, 4, 4)
    squared = [float(((output[b] - target[b]) ** 2).sum()) for b in range(2)]
    assert float(_fast_ddpm().regression_loss(output, target)) == pytest.approx(sum(squared) / 128, rel=1e-5)
    assert float(_fast_ddpm(loss_reduction="sum").regression_loss(output, target)) == pytest.approx(sum(squared) / 2,
                                                                                                    rel=1e-5)


def test_low_precision_group_norm_normalises_in_the_autocast_dtype_and_is_groupnorm_outside():
    from monai.networks.nets import DiffusionModelUNet

    from lightning_modules.diffusion.fast_ddpm import ConditionalDiffusion
    from lightning_modules.diffusion.low_precision_norm import LowPrecisionGroupNorm

    torch.manual_seed(0)
    norm = nn.GroupNorm(2, 4)
    nn.init.normal_(norm.weight)
    nn.init.normal_(norm.bias)
    low = copy.deepcopy(norm)
    low.__class__ = LowPrecisionGroupNorm
    x = torch.randn(2, 4, 3, 3, 3) * 3 + 1
    assert torch.equal(low(x), norm(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # A float32 input: nn.GroupNorm keeps it float32 there; this one normalises it in bf16, as by hand.
        assert norm(x).dtype == torch.float32
        out = low(x)
    by_hand = F.group_norm(x.bfloat16(), 2, norm.weight.bfloat16(), norm.bias.bfloat16(), norm.eps)
    assert out.dtype == torch.bfloat16 and torch.equal(out, by_hand)
    unet = partial(DiffusionModelUNet, spatial_dims=3, channels=(8, 8), attention_levels=(False, True),
                   num_res_blocks=1, norm_num_groups=4, num_head_channels=4)
    module = ConditionalDiffusion(unet, image_channels=1, cond_channels=1, low_precision_norm=True)
    norms = [m for m in module.network.modules() if isinstance(m, nn.GroupNorm)]
    assert norms and all(type(m) is LowPrecisionGroupNorm for m in norms)
    plain = ConditionalDiffusion(unet, image_channels=1, cond_channels=1)
    assert module.state_dict().keys() == plain.state_dict().keys()
