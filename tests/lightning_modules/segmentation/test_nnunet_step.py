"""medvol's planned training step against nnU-Net v2's own, recorded in tests/data/nnunet_step.pt by
`benchmarks/segmentation/nnunet_plans.py step` (run in a venv that has nnunetv2 2.8.1; the file says which made it).

nnU-Net's PlainConvUNet (4 stages, its He initialisation) took a fixed batch of the 3 BraTS regions through its
deep-supervision loss (DC_and_BCE_loss per head against targets pooled by batchgeneratorsv2, weights 1/2^i with
the lowest 0), clip_grad_norm_(12) and its SGD, three times. Here medvol's Segmenter (DynUNet without residual
blocks, as a plan builds it) gets the same weights and batch, `training_loss`, the plan's gradient clip and the
optimizer of conf/model/segmentation.yaml: every figure must be nnU-Net's (MONAI's Dice loss is 1 - Dice where
nnU-Net's is -Dice, so medvol's losses are nnU-Net's plus 1)."""

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from benchmarks.segmentation.nnunet_plans import dynunet_parameter, load_nnunet_weights, nested_regions
from lightning_modules.segmentation.segmentation import Segmenter
from medvol.run.planning import GRADIENT_CLIP

ROOT = Path(__file__).resolve().parents[3]
REFERENCE = torch.load(ROOT / "tests" / "data" / "nnunet_step.pt", weights_only=True)
REGIONS = {"WT": [1, 2, 3], "TC": [1, 3], "ET": [3]}


def segmenter_with_nnunets_weights() -> Segmenter:
    setting = REFERENCE["setting"]
    optimizer = instantiate(OmegaConf.load(ROOT / "conf" / "model" / "segmentation.yaml").optimizer)
    module = Segmenter(
        in_channels=setting["channels"], net="dynunet", regions=REGIONS, features=[2, 4, 8, 16],
        kernels=[[3, 3, 3]] * 4, strides=[[1, 1, 1], [2, 2, 2], [2, 2, 2], [2, 2, 2]], deep_supervision=True,
        res_block=False, transposed_bias=True, patch_size=setting["patch"], optimizer=optimizer,
    ).train()
    load_nnunet_weights(module.net, REFERENCE)
    return module


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    setting = REFERENCE["setting"]
    return REFERENCE["image"].float(), torch.from_numpy(nested_regions(setting["batch"], setting["patch"]))


def test_the_first_step_is_nnunets_output_loss_and_gradient():
    module = segmenter_with_nnunets_weights()
    image, regions = batch()
    output = module(image)
    heads = [output[:, 0], *module.net.heads]
    assert [float(h.detach().double().norm()) for h in heads] == pytest.approx(REFERENCE["output_norms"], rel=1e-5)
    loss = module.training_loss(output, regions)
    assert float(loss) == pytest.approx(REFERENCE["losses"][0] + 1.0, abs=1e-5)
    loss.backward()
    parameters = dict(module.net.named_parameters())
    compared = set()
    for name, norm in REFERENCE["grad_norms"].items():
        ours = dynunet_parameter(name, REFERENCE["stages"])
        if ours is not None:
            assert float(parameters[ours].grad.double().norm()) == pytest.approx(norm, rel=1e-4, abs=1e-7), name
            compared.add(ours)
    # Every parameter of medvol's network has nnU-Net's gradient, the upsampling biases included; only the coarsest
    # head (weight 0) takes none in either.
    coarsest = {dynunet_parameter(f"decoder.seg_layers.0.{f}", REFERENCE["stages"]) for f in ("weight", "bias")}
    assert set(parameters) - compared == coarsest and any(n.endswith("transp_conv.conv.bias") for n in compared)


def test_the_convolution_biases_medvol_leaves_out_never_move_in_nnunets_step():
    """PlainConvUNet has a bias on every convolution (`conv_bias=True`); medvol's DynUNet only on the transposed ones
    and the heads. Each bias it leaves out feeds an instance norm, which subtracts the channel mean: in nnU-Net's own
    step its gradient is float noise, under 1e-6 of its convolution weight's, so it stays at its initial 0. The
    transposed convolutions' biases do learn (the next convolution's zero padding keeps them from cancelling)."""
    norms = REFERENCE["grad_norms"]
    left_out = [n for n in norms if n.endswith("conv.bias") and dynunet_parameter(n, REFERENCE["stages"]) is None]
    assert len(left_out) == 2 * (2 * REFERENCE["stages"] - 1)
    for name in left_out:
        assert norms[name] < 1e-6 * norms[name.removesuffix("bias") + "weight"], name
    upsampling = [n for n in norms if n.startswith("decoder.transpconvs.") and n.endswith(".bias")]
    assert len(upsampling) == REFERENCE["stages"] - 1
    assert all(norms[n] > 1e-2 * norms[n.removesuffix("bias") + "weight"] for n in upsampling)


def test_three_steps_follow_nnunets_losses():
    """The optimizer and clipping too: the losses after one and two updates are nnU-Net's."""
    module = segmenter_with_nnunets_weights()
    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    image, regions = batch()
    losses = []
    for _ in REFERENCE["losses"]:
        optimizer.zero_grad(set_to_none=True)
        loss = module.training_loss(module(image), regions)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.net.parameters(), GRADIENT_CLIP)
        optimizer.step()
        losses.append(float(loss.detach()) - 1.0)
    assert losses == pytest.approx(REFERENCE["losses"], abs=1e-5)
