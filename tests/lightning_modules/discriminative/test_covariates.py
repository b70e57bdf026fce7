"""`CovariateScaler`: z-scores with the training split's mean and population std, kept as checkpoint buffers."""

from __future__ import annotations

import numpy as np
import torch

from lightning_modules.discriminative.covariates import CovariateScaler

# Age, a 0/1 flag and a constant column (one site only).
TABLE = np.array([[61.0, 0.0, 3.0], [47.0, 1.0, 3.0], [75.0, 1.0, 3.0], [52.0, 0.0, 3.0], [66.0, 1.0, 3.0]])


def test_the_statistics_are_numpys_mean_and_population_std_of_the_training_table():
    scaler = CovariateScaler(3)
    scaler.fit(torch.from_numpy(TABLE).float())
    np.testing.assert_allclose(scaler.mean.numpy(), TABLE.mean(0), rtol=1e-6)
    # The constant column is centred only: its std stays 1 instead of dividing by zero.
    np.testing.assert_allclose(scaler.std.numpy(), [TABLE[:, 0].std(ddof=0), TABLE[:, 1].std(ddof=0), 1.0], rtol=1e-6)
    assert bool(scaler.fitted)


def test_the_forward_is_the_z_score_in_the_inputs_dtype():
    scaler = CovariateScaler(3)
    scaler.fit(torch.from_numpy(TABLE))
    new = np.array([[58.0, 1.0, 3.0], [80.0, 0.0, 3.0]])
    out = scaler(torch.from_numpy(new).float())
    expected = (new - TABLE.mean(0)) / np.where(TABLE.std(0) > 0, TABLE.std(0), 1.0)
    assert out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_a_single_training_row_is_centred_and_not_scaled():
    scaler = CovariateScaler(2)
    scaler.fit(torch.tensor([[4.0, -2.0]]))
    assert scaler(torch.tensor([[5.0, 0.0]])).tolist() == [[1.0, 2.0]]


def test_an_unfitted_scaler_is_the_identity_and_the_statistics_travel_in_the_state_dict():
    assert CovariateScaler(3)(torch.from_numpy(TABLE)).tolist() == TABLE.tolist()
    fitted = CovariateScaler(3)
    fitted.fit(torch.from_numpy(TABLE))
    restored = CovariateScaler(3)
    restored.load_state_dict(fitted.state_dict())
    assert bool(restored.fitted)
    assert torch.equal(restored(torch.from_numpy(TABLE)), fitted(torch.from_numpy(TABLE)))
