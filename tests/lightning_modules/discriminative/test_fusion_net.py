"""`ImageCovariateNet`: pooled image features joined with z-scored covariates (late fusion), then the head."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_modules.discriminative.fusion_net import ImageCovariateNet

COVARIATES = np.array([[61.0, 0.0], [47.0, 1.0], [75.0, 1.0], [52.0, 0.0]])


def test_the_head_sees_the_image_features_then_the_z_scored_covariates():
    torch.manual_seed(0)
    net = ImageCovariateNet(outputs=3, backbone="resnet10", num_covariates=2, widen_factor=0.125, dropout=0.5).eval()
    net.covariates.fit(torch.from_numpy(COVARIATES))
    image = torch.randn(4, 1, 16, 16, 16)
    z_scores = (COVARIATES - COVARIATES.mean(0)) / COVARIATES.std(0)
    with torch.no_grad():
        features = net.backbone(image).numpy().astype(np.float64)
        joined = np.concatenate([features, z_scores], axis=1)
        expected = joined @ net.head.weight.numpy().T.astype(np.float64) + net.head.bias.numpy()
        out = net(image, torch.from_numpy(COVARIATES).float())
    assert net.head.in_features == 64 + 2
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-5)


def test_a_covariate_alone_moves_the_output_through_its_head_weight():
    torch.manual_seed(1)
    net = ImageCovariateNet(outputs=1, backbone="resnet10", num_covariates=2, widen_factor=0.125).eval()
    net.covariates.fit(torch.from_numpy(COVARIATES))
    image = torch.randn(1, 1, 16, 16, 16).expand(2, -1, -1, -1, -1)
    older = torch.tensor([[50.0, 1.0], [60.0, 1.0]])
    with torch.no_grad():
        out = net(image, older)
    # Ten years are 10 / std z-units, each worth the head's weight for age.
    expected = 10 / COVARIATES[:, 0].std() * net.head.weight[0, 64].item()
    assert float(out[1, 0] - out[0, 0]) == pytest.approx(expected, rel=1e-4)


def test_an_image_only_network_has_no_scaler_and_a_head_over_the_features_alone():
    net = ImageCovariateNet(outputs=2, backbone="resnet10", widen_factor=0.125).eval()
    assert net.covariates is None and net.head.in_features == 64
    with torch.no_grad():
        assert net(torch.randn(3, 1, 16, 16, 16)).shape == (3, 2)
