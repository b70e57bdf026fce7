"""The planned network (lightning_modules/segmentation/networks.py): MONAI's DynUNet laid out as nnU-Net's
PlainConvUNet (no residual blocks), with the plan's anisotropic strides and kernels."""

from __future__ import annotations

import torch
from monai.networks.blocks.dynunet_block import UnetBasicBlock, UnetResBlock

from lightning_modules.segmentation.networks import build_network


def test_the_planned_dynunet_has_plain_blocks_and_the_plans_strides_and_kernels():
    strides = [[1, 1, 1], [2, 2, 1], [2, 2, 2]]
    kernels = [[3, 3, 1], [3, 3, 3], [3, 3, 3]]
    plain = build_network("dynunet", 2, 3, [4, 8, 16], 24, kernels, strides, deep_supervision=True, res_block=False)
    residual = build_network("dynunet", 2, 3, [4, 8, 16], 24, kernels, strides, res_block=True)
    assert isinstance(plain.input_block, UnetBasicBlock) and isinstance(residual.input_block, UnetResBlock)
    # Two convolutions per stage, the first strided, as nnU-Net's StackedConvBlocks.
    convs = [m for m in plain.downsamples[0].modules() if isinstance(m, torch.nn.Conv3d)]
    assert len(convs) == 2 and list(convs[0].stride) == [2, 2, 1] and list(convs[0].kernel_size) == [3, 3, 3]
    assert list(plain.input_block.conv1.conv.kernel_size) == [3, 3, 1]
    out = plain.train()(torch.zeros(2, 2, 16, 16, 8))
    assert out.shape == (2, 2, 3, 16, 16, 8)  # the output and one deep-supervision head, upsampled


def test_swinunetr_attends_fused_in_inference_and_equals_monais_explicit_attention():
    from monai.networks.nets import SwinUNETR
    from monai.networks.nets.swin_unetr import WindowAttention

    torch.manual_seed(0)
    fused = build_network("swinunetr", 1, 2, [4, 8], 12).eval()
    assert all(m.use_flash_attention for m in fused.modules() if isinstance(m, WindowAttention))
    explicit = SwinUNETR(in_channels=1, out_channels=2, feature_size=12, spatial_dims=3).eval()
    # The same weights: each network's checkpoint loads in the other.
    assert fused.state_dict().keys() == explicit.state_dict().keys()
    explicit.load_state_dict(fused.state_dict())
    x = torch.randn(1, 1, 64, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), explicit(x), rtol=1e-4, atol=1e-5)
