"""The inference preflight (medvol/run/inference_preflight.py): predict.py's window batches sized from a network call's
peak predicted on fake tensors, an explicit batch that will not fit refused, `preflight=<card>` printing the plan."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from medvol.core.build import build_model
from medvol.core.errors import MedvolError
from medvol.core.gpu_cards import card_named
from medvol.run.inference_preflight import (
    CPU_WINDOW_BATCH,
    Memory,
    call_peak,
    decoding_call,
    emulated_precision,
    fits,
    plan_decoding,
    plan_inference,
    plan_sampling,
    plan_sliding_window,
    sampling_calls,
    sliding_window_call,
)
from medvol.run.preflight import MARGIN
from medvol.run.settings_bounds import MAX_WINDOW_BATCH, PredictSizes, check_predict_sizes
from medvol.run.training import run
from tests.conftest import ROOT, TINY_COMMON, TINY_MODEL, compose_cfg, subprocess_env
from tests.lightning_modules.diffusion.test_windowed_sampling import _xray_stage_two

CPU = torch.device("cpu")


def conv_net_call() -> tuple[nn.Module, Callable]:
    """Two 3D convolutions around a ReLU, 1 -> 8 -> 2 channels, and its call on `count` windows of 16^3."""
    net = nn.Sequential(nn.Conv3d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv3d(8, 2, 3, padding=1))

    def call(count: int):
        window = torch.randn(count, 1, 16, 16, 16)
        return [window], lambda: net(window)

    return net, call


def conv_net_weights(element_bytes: int) -> int:
    """The conv net's weights and biases at `element_bytes` a value, each tensor in the allocator's 512-byte blocks."""
    return sum(-(-numel * element_bytes // 512) * 512 for numel in (8 * 27, 8, 2 * 8 * 27, 2))


def test_a_conv_nets_predicted_window_peak_is_its_hand_counted_weights_windows_and_two_activations():
    net, call = conv_net_call()
    # Weights and biases (float32), the windows, and at the peak the first convolution's output beside the ReLU's
    # (the ReLU is not in place): 8 channels of 16^3 each, per window.
    for count in (1, 4):
        voxels = count * 16**3
        assert call_peak(net, call, count) == conv_net_weights(4) + voxels * 4 + 2 * 8 * voxels * 4
    assert all(type(p) is nn.Parameter and not p.is_meta for p in net.parameters())  # the net's own weights, back


def test_under_bf16_autocast_the_conv_nets_activations_are_counted_in_bf16():
    """predict.py's `precision=bf16` (auto on a GPU): the convolutions run in bf16 as CUDA's autocast runs them, so the
    two activations alive at the peak take 2 bytes a value; the weights and the windows stay float32, and autocast
    keeps a bf16 copy of each weight for the rest of predict.py's autocast region (the window's cast is freed)."""
    net, call = conv_net_call()
    with emulated_precision("bf16"):
        for count in (1, 4):
            voxels = count * 16**3
            assert call_peak(net, call, count) == (conv_net_weights(4) + conv_net_weights(2) + voxels * 4
                                                   + 2 * 8 * voxels * 2)
    with emulated_precision("32"):
        assert call_peak(net, call, 1) == conv_net_weights(4) + 16**3 * 4 + 2 * 8 * 16**3 * 4


def tiny_vqgan(tmp_path: Path):
    cfg = compose_cfg(tmp_path, ["model=vqgan"])
    return build_model(cfg.model).eval()


@pytest.mark.parametrize("memory_mib", [12, 20, 40])
def test_the_window_batch_is_the_largest_whose_peak_and_margin_fit(tmp_path, memory_mib):
    module = tiny_vqgan(tmp_path)
    memory = Memory("card", memory_mib / 1024, True)
    plan = plan_sliding_window(module, [16, 16, 16], "auto", memory)
    call = sliding_window_call(module, [16, 16, 16])
    assert plan.peak == call_peak(module, call, plan.batch)
    assert plan.peak * (1 + MARGIN) <= memory_mib * 2**20
    if plan.batch < MAX_WINDOW_BATCH:
        assert call_peak(module, call, plan.batch + 1) * (1 + MARGIN) > memory_mib * 2**20


def test_the_window_batch_grows_with_the_memory_and_shrinks_with_the_window(tmp_path):
    module = tiny_vqgan(tmp_path)

    def batch(memory_mib: int, edge: int) -> int:
        return plan_sliding_window(module, [edge] * 3, "auto", Memory("card", memory_mib / 1024, True)).batch

    by_memory = [batch(mib, 16) for mib in (12, 20, 40)]
    assert by_memory == sorted(by_memory) and by_memory[0] < by_memory[-1] < MAX_WINDOW_BATCH, by_memory
    by_window = [batch(40, edge) for edge in (16, 24, 32)]
    assert by_window == sorted(by_window, reverse=True) and by_window[0] > by_window[-1], by_window


def test_an_explicit_batch_that_fits_is_kept_and_one_that_does_not_is_refused_naming_the_largest(tmp_path):
    module = tiny_vqgan(tmp_path)
    memory = Memory("card", 20 / 1024, True)
    largest = plan_sliding_window(module, [16, 16, 16], "auto", memory).batch
    assert plan_sliding_window(module, [16, 16, 16], largest, memory).batch == largest
    with pytest.raises(MedvolError) as refusal:
        plan_sliding_window(module, [16, 16, 16], largest + 1, memory)
    assert "\n" not in str(refusal.value)
    assert f"`sw_batch_size={largest + 1}` predicts" in str(refusal.value)
    peak = plan_sliding_window(module, [16] * 3, largest, memory).peak
    assert str(refusal.value).endswith(f"the largest that fits is sw_batch_size={largest} ({peak / 2**20:.1f} MiB)")


def test_on_the_cpu_auto_keeps_todays_batches_and_nothing_is_measured(tmp_path, monkeypatch):
    module = tiny_vqgan(tmp_path)
    monkeypatch.setattr("medvol.run.inference_preflight.call_peak", lambda *a: pytest.fail("measured on the CPU"))
    plan = plan_inference(module, PredictSizes(), CPU, roi=[16, 16, 16])
    assert (plan.sw_batch_size, plan.sampling_window_batch_size, plan.named) == (CPU_WINDOW_BATCH, None, False)
    sizes = check_predict_sizes({"sw_batch_size": 7, "sampling_window_batch_size": 3}, "predict.py")
    assert plan_inference(module, sizes, CPU, roi=[16, 16, 16]).sw_batch_size == 7
    with pytest.raises(MedvolError, match=r"`sw_batch_size` is 65; expected auto or a whole number in \[1, 64\]"):
        check_predict_sizes({"sw_batch_size": 65}, "predict.py")


def test_the_xray_to_ct_walks_window_batch_comes_from_the_prediction_below_the_cap(tmp_path):
    # Stage 2 (16^3, by 8^3 windows) over a whole stage 1 (8^3): one batch serves both stages' calls.
    module = _xray_stage_two(tmp_path, crop_size=8).eval()
    memory = Memory("0.01GiB", 0.01, True)
    plan = plan_sampling(module, "auto", memory)
    assert 1 < plan.batch < MAX_WINDOW_BATCH and fits(plan.peak, memory)
    assert "(auto) on stage 1: the whole 8x8x8, stage 2: windows of 8x8x8: predicted peak" in plan.line()
    larger = plan_sampling(module, "auto", Memory("0.05GiB", 0.05, True))
    assert larger.batch == MAX_WINDOW_BATCH
    with pytest.raises(MedvolError, match=f"the largest that fits is sampling_window_batch_size={plan.batch} "):
        plan_sampling(module, MAX_WINDOW_BATCH, memory)


def test_a_fast_ddpm_sampling_window_costs_its_hand_counted_six_volumes_and_no_window_plans_nothing():
    from lightning_modules.diffusion.diffusion_module import sampling_window_size
    from tests.lightning_modules.diffusion.test_windowed_sampling import _fast_ddpm

    module = _fast_ddpm(sampling_window=8).eval()
    (call,) = sampling_calls(module)
    # Per 8^3 window (float32): x_t and its cut of the condition in, their concatenation (2 channels: the network's
    # input, alive through its call), the convolution's output and the step added to it: 6 volumes of 2 KiB.
    assert call_peak(module, call.call, 5) - call_peak(module, call.call, 1) == 4 * 6 * 8**3 * 4
    small, large = (plan_sampling(module, "auto", Memory("card", mib / 1024, True)).batch for mib in (0.2, 0.4))
    assert small < large
    module.sampling_window = sampling_window_size(None)
    assert plan_sampling(module, "auto", Memory("card", 1.0, True)) is None


def test_the_planned_sampling_batch_is_the_one_the_walk_runs_with(tmp_path):
    module = _xray_stage_two(tmp_path, crop_size=8).eval()
    sizes = PredictSizes()
    # No window (roi None): X-ray-to-CT runs no sliding window, so none is asked for.
    plan = plan_inference(module, sizes, CPU, card="0.01GiB")
    assert plan.named and plan.sampling_window_batch_size == plan_sampling(
        module, "auto", Memory("0.01GiB", 0.01, True)).batch


def test_the_ldms_decoder_slab_is_the_largest_power_of_two_whose_decoding_fits_and_the_decoder_gets_it(tmp_path):
    from lightning_modules.ldm.first_stage import VQGAN_CLASS
    from lightning_modules.vqgan.vqgan import VQGAN
    from tests.lightning_modules.ldm.test_ldm import TINY_VQGAN, save_checkpoint, tiny_ldm

    first_stage = save_checkpoint(VQGAN(**TINY_VQGAN), tmp_path / "vqgan.ckpt", VQGAN_CLASS)
    module = tiny_ldm(first_stage, sample_size=[32, 32, 32]).eval()
    module.scale_factor.fill_(1.0)
    latent = [1, TINY_VQGAN["embedding_dim"], 8, 8, 8]
    slabs = []
    for mib in (6, 8, 64):
        memory = Memory("card", mib / 1024, True)
        plan = plan_decoding(module, "auto", memory)
        assert plan.peak == call_peak(module, decoding_call(module, latent, plan.batch), 1) and fits(plan.peak, memory)
        if plan.batch < 2**31:
            assert not fits(call_peak(module, decoding_call(module, latent, 2 * plan.batch), 1), memory)
        slabs.append(plan.batch)
    assert slabs == sorted(slabs) and slabs[0] < slabs[-1], slabs
    with pytest.raises(MedvolError, match="no slab keeps the decoder's activations on the device"):
        plan_decoding(module, "auto", Memory("card", 2 / 1024, True))
    plan_inference(module, PredictSizes(), CPU, card="8GB").apply(module)
    card = card_named("8GB")
    assert module.hparams.decode_slab_elements == plan_decoding(module, "auto", Memory(card.name, card.memory_gib,
                                                                                      True)).batch
    assert module.hparams.decode_offload is None and not module.progress


@pytest.fixture(scope="module")
def vqgan_run(tmp_path_factory) -> Path:
    """A tiny VQ-GAN run on the phantoms, its config where train.py saves it."""
    run_dir = tmp_path_factory.mktemp("inference-preflight") / "run"
    cfg = compose_cfg(run_dir, [*TINY_COMMON, *TINY_MODEL["vqgan"], "logger=none", "callbacks.volume_slices=null"],
                      tiny=False)
    run(cfg)
    (run_dir / ".hydra").mkdir(exist_ok=True)
    OmegaConf.save({k: v for k, v in cfg.items() if k != "hydra"}, run_dir / ".hydra" / "config.yaml")
    return run_dir


def predict_command(run_dir: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "predict.py"), f"ckpt_path={run_dir}/checkpoints/last.ckpt", "split=test",
         f"output_dir={out}", "device=cpu", *extra],
        capture_output=True, text=True, cwd=out.parent, timeout=300, env=subprocess_env(OMP_NUM_THREADS="1"),
    )


def test_preflight_on_a_card_prints_the_plan_and_writes_nothing(vqgan_run, tmp_path):
    result = predict_command(vqgan_run, tmp_path / "out", "preflight=H100")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "inference preflight" in line]
    assert len(lines) == 1 and "sw_batch_size=64 (auto) on windows of 16x16x16" in lines[0], result.stdout
    assert lines[0].endswith("H100 has 79.18 GiB")
    assert not (tmp_path / "out").exists()


def test_a_batch_that_will_not_fit_the_named_card_is_refused_in_one_line_before_anything_is_written(vqgan_run,
                                                                                                     tmp_path):
    result = predict_command(vqgan_run, tmp_path / "out", "preflight=0.015GiB", "sw_batch_size=64")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("medvol: error: `sw_batch_size=64` predicts "), result.stderr
    assert "0.015GiB has 15.4 MiB: the largest that fits is sw_batch_size=" in lines[0]
    assert not (tmp_path / "out").exists()


def test_on_a_gpu_the_window_runs_with_the_planned_batch_and_one_line_says_so(vqgan_run, tmp_path, monkeypatch,
                                                                              caplog):
    from medvol.run import inference_preflight
    from medvol.run.predicting import predict
    from medvol.volumes.sliding_window import SlidingWindow
    from tests.medvol.run.test_predict import predict_cfg

    # The CPU stands in for a GPU with 15 MiB free: the plan is what a GPU's free memory would give.
    memory = Memory("GPU", 0.015, False)
    monkeypatch.setattr(inference_preflight, "device_memory", lambda card, device: memory)
    expected = plan_sliding_window(tiny_vqgan(tmp_path / "m"), [16, 16, 16], "auto", memory)
    batches = []
    run_window = SlidingWindow.__call__
    monkeypatch.setattr(SlidingWindow, "__call__", lambda self, *a, **k: batches.append(self.batch_size) or
                        run_window(self, *a, **k))
    with caplog.at_level("INFO", logger="medvol"):
        predict(predict_cfg(f"ckpt_path={vqgan_run}/checkpoints/last.ckpt", "split=test",
                            f"output_dir={tmp_path / 'out'}"))
    assert 1 < expected.batch < MAX_WINDOW_BATCH and batches and set(batches) == {expected.batch}
    lines = [r.getMessage() for r in caplog.records if "inference preflight" in r.getMessage()]
    assert lines == [expected.line()] and lines[0].endswith("GPU free 15.4 MiB")


def test_the_precision_is_bf16_on_a_gpu_or_a_named_card_and_float32_on_the_cpu():
    from medvol.run.predict_check import pick_precision

    assert pick_precision("auto", CPU) == "32" and pick_precision(32, CPU) == "32"
    assert pick_precision("auto", CPU, named=True) == "bf16" and pick_precision("bf16", CPU) == "bf16"
    # On a GPU (played: a CUDA device whose bf16 support is asked of torch), auto is bf16 where the card has it.
    for supported, expected in ((True, "bf16"), (False, "32")):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.cuda, "is_bf16_supported", lambda *a, answer=supported, **k: answer)
            assert pick_precision("auto", torch.device("cuda")) == expected
    with pytest.raises(MedvolError, match=r"^`precision` is 'fp8'; expected auto, 32 or bf16$"):
        pick_precision("fp8", CPU)


def test_predict_in_bf16_runs_the_network_under_autocast_and_auto_on_the_cpu_is_float32(vqgan_run, tmp_path,
                                                                                       monkeypatch):
    """`precision=bf16` (auto on a GPU) runs each window's network call under bf16 autocast, the blend and the writing
    outside it; on the CPU `auto` predicts in float32, bit for bit as `precision=32`."""
    import nibabel as nib
    import numpy as np

    from lightning_modules.vqgan.vqgan import VQGAN
    from medvol.run.predicting import predict
    from tests.medvol.run.test_predict import predict_cfg

    dtypes = []
    forward = VQGAN.forward
    monkeypatch.setattr(VQGAN, "forward", lambda self, x, *a, **k: dtypes.append(
        self.encoder(x[:1]).dtype) or forward(self, x, *a, **k))
    outputs = {}
    for precision in ("32", "auto", "bf16"):
        dtypes.clear()
        out = tmp_path / precision
        predict(predict_cfg(f"ckpt_path={vqgan_run}/checkpoints/last.ckpt", "split=test", f"precision={precision}",
                            f"output_dir={out}"))
        assert dtypes and set(dtypes) == {torch.bfloat16 if precision == "bf16" else torch.float32}
        outputs[precision] = {p.name: nib.load(str(p)).get_fdata() for p in sorted(out.glob("*_reconstruction.nii.gz"))}
    assert outputs["32"].keys() == outputs["bf16"].keys() and outputs["32"]
    for name, exact in outputs["32"].items():
        np.testing.assert_array_equal(outputs["auto"][name], exact)
        assert not np.array_equal(outputs["bf16"][name], exact)
        assert np.abs(outputs["bf16"][name] - exact).mean() < 0.05 * np.ptp(exact)
