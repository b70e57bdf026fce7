"""Per-subject noise: a subject's streams do not depend on its batch position, its batch, the rank or the global
RNG; salts, seeds and subjects tell streams apart; both diffusion families sample a subject alike alone or in a
batch."""

from __future__ import annotations

import pytest
import torch

from lightning_modules.diffusion.subject_noise import SubjectNoise, subject_names
from tests.lightning_modules.diffusion.test_windowed_sampling import _fast_ddpm, _live_xray_stage

SHAPE = (1, 4, 4, 4)


def _draws(subjects: list[str], rank_seed: int, salt: str = "sample") -> dict[str, list[torch.Tensor]]:
    """Three successive draws and a step index per subject, as one rank would make them for its batch."""
    torch.manual_seed(rank_seed)
    torch.randn(7)  # whatever the rank did with the global RNG before
    noise = SubjectNoise(subjects, seed=3, salt=salt)
    first, steps, second = noise.draw(SHAPE), noise.integers(1000), noise(torch.empty(len(subjects), *SHAPE))
    return {s: [first[i], steps[i], second[i]] for i, s in enumerate(subjects)}


def test_a_subject_draws_the_same_noise_in_any_batch_position_batch_and_rank():
    one_batch = _draws(["a", "b", "c", "d"], rank_seed=0)
    # Two simulated ranks, each with its own share, order and global RNG state.
    rank0, rank1 = _draws(["c", "a"], rank_seed=1), _draws(["d", "b"], rank_seed=2)
    alone = _draws(["b"], rank_seed=5)
    for subject, draws in {**rank0, **rank1}.items():
        for got, want in zip(draws, one_batch[subject], strict=True):
            assert torch.equal(got, want), subject
    assert all(torch.equal(g, w) for g, w in zip(alone["b"], one_batch["b"], strict=True))
    # Successive draws continue the stream; subjects differ.
    assert not torch.equal(one_batch["a"][0], one_batch["a"][2])
    assert not torch.equal(one_batch["a"][0], one_batch["b"][0])


def test_salts_and_seeds_give_other_streams():
    base = SubjectNoise(["a"], seed=0, salt="stage1").draw(SHAPE)
    assert torch.equal(SubjectNoise(["a"], seed=0, salt="stage1").draw(SHAPE), base)
    for other in (SubjectNoise(["a"], seed=0, salt="stage2"), SubjectNoise(["a"], seed=0, salt="stage1/previous"),
                  SubjectNoise(["a"], seed=1, salt="stage1")):
        drawn = other.draw(SHAPE)
        assert not torch.equal(drawn, base)
        # Independent streams: hardly correlated.
        assert abs(torch.corrcoef(torch.stack([drawn.flatten(), base.flatten()]))[0, 1]) < 0.5


def test_names_come_from_the_batch_or_from_the_batch_index_and_position():
    assert subject_names({"subject": ["x", "y"]}, 4, 2) == ["x", "y"]
    assert subject_names({}, 4, 2) == ["batch4-0", "batch4-1"]


def _xray_samples(views: torch.Tensor, subjects: list[str]) -> torch.Tensor:
    module = _live_xray_stage(1, 8, eta=1.0)
    torch.manual_seed(len(subjects))  # another global RNG state, as on another rank
    return module.generate(views, [8, 8, 8], subjects)["ct"]


def _fast_ddpm_samples(cond: torch.Tensor, subjects: list[str]) -> torch.Tensor:
    module = _fast_ddpm(eta=1.0, timesteps=4)
    module.log = lambda *args, **kwargs: None
    torch.manual_seed(len(subjects))
    batch = {"image": torch.zeros(len(subjects), 1, 8, 8, 8), "cond": cond, "subject": subjects}
    return module.validation_step(batch, 0)["volumes"]["sample"]


@pytest.mark.parametrize(
    ("sampler", "shape"), [(_xray_samples, (2, 2, 16, 16)), (_fast_ddpm_samples, (2, 1, 8, 8, 8))],
    ids=["xray2ct", "fast_ddpm"],
)
def test_stochastic_sampling_gives_a_subject_the_same_sample_alone_or_in_a_batch(sampler, shape):
    condition = torch.rand(shape, generator=torch.Generator().manual_seed(11))
    # eta = 1: every DDIM step draws noise too, from the subject's own stream.
    pair = sampler(condition, ["s0", "s1"])
    alone = sampler(condition[1:], ["s1"])
    # A convolution over a batch of 1 and of 2 rounds differently: over 25 random conditions the X-ray walk ended
    # up to 1.1e-5 apart (samples in [-1, 1]); a subject drawing another subject's noise is off by ~0.1 or more.
    torch.testing.assert_close(alone[0], pair[1], rtol=0, atol=1e-4)
    assert not torch.allclose(pair[0], pair[1], atol=1e-3)
