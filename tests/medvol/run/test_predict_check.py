"""predict.py's checks on their own: each refusal names its key, the overlap and window fall back as documented."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from medvol.core.errors import MedvolError
from medvol.run.predict_check import check_predict, pick_device, window_roi

SEGMENTER = "lightning_modules.segmentation.segmentation.Segmenter"
RUN = OmegaConf.create(
    {"model": {"_target_": SEGMENTER, "overlap": 0.5, "patch_size": [8, 8, 8]}, "dataset": {"size": 16}}
)
LDM = "lightning_modules.ldm.latent_diffusion.LatentDiffusion"


def command(**values):
    base = {"mode": "gaussian", "overlap": None, "split": None, "num_samples": 1, "input": "scan.nii.gz", "roi": None}
    return OmegaConf.create({**base, **values})


def test_the_overlap_is_the_models_own_unless_given_and_else_a_quarter():
    assert check_predict(command(), RUN) == 0.5
    assert check_predict(command(overlap=0.1), RUN) == 0.1
    assert check_predict(command(), OmegaConf.create({"model": {"_target_": SEGMENTER}})) == 0.25


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"mode": "linear"}, "`mode` is 'linear'"),
        ({"overlap": 1.0}, "`overlap` must be in [0, 1)"),
        ({"split": "holdout"}, "`split` is 'holdout'"),
        ({"num_samples": 0}, "`num_samples` is 0"),
        ({"num_samples": True}, "`num_samples` is True"),
        ({"input": None}, "`input` is not set"),
    ],
)
def test_each_bad_value_is_one_line_naming_its_key(values, message):
    with pytest.raises(MedvolError) as caught:
        check_predict(command(**values), RUN)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_only_an_unconditional_generator_runs_with_no_input_at_all():
    check_predict(command(input=None), OmegaConf.create({"model": {"_target_": LDM, "cond_channels": 0}}))
    for run in ({"_target_": LDM, "cond_channels": 1}, {"_target_": SEGMENTER}):
        with pytest.raises(MedvolError, match="`input` is not set"):
            check_predict(command(input=None), OmegaConf.create({"model": run}))
    # A split or a dataset is an input too.
    check_predict(command(input=None, split="test"), RUN)


def test_the_window_is_the_training_patch_unless_roi_is_given_and_three_positive_sizes():
    assert window_roi(command().roi, RUN) == [8, 8, 8]
    assert window_roi(command(roi=[4, 6, 8]).roi, RUN) == [4, 6, 8]
    for roi in ([8, 8], [8, 0, 8]):
        with pytest.raises(MedvolError, match="`roi` is"):
            window_roi(command(roi=roi).roi, RUN)


def test_a_device_is_named_as_torch_names_it_and_cuda_without_a_gpu_is_refused():
    assert pick_device("cpu") == torch.device("cpu")
    with pytest.raises(MedvolError, match="`device` is 'tpu'"):
        pick_device("tpu")
    if not torch.cuda.is_available():
        assert pick_device("auto") == torch.device("cpu")
        with pytest.raises(MedvolError, match="no CUDA device is visible"):
            pick_device("cuda:0")


def test_the_request_holds_the_commands_values_checked_once_and_refuses_a_bad_window_first(tmp_path):
    from medvol.run.predict_check import predict_request

    given = {"output_dir": str(tmp_path / "out"), "device": "cpu", "codes": True, "save_probabilities": False}
    request = predict_request(command(roi=[4, 6, 8], **given), RUN)
    assert (request.roi, request.overlap, request.device, request.precision) == ([4, 6, 8], 0.5, torch.device("cpu"),
                                                                                 "32")
    assert request.extras == ("codes",) and request.source is not None and not request.from_noise
    # The run's own window where the command gives none; None where the run names none (refused where a window runs).
    assert predict_request(command(**given), RUN).roi == [8, 8, 8]
    assert predict_request(command(**given), OmegaConf.create({"model": {"_target_": SEGMENTER}, "dataset": {}})
                           ).roi is None
    # The values the later stages read, typed: a series named by digits is a name, a covariates file a path.
    typed = predict_request(command(**given, series=2, covariates="~/c.csv", tta=False, split="test",
                                    sw_batch_size=3, preflight="H100"), RUN)
    assert (typed.series, typed.covariates, typed.tta, typed.split, typed.card) == (
        "2", Path("~/c.csv").expanduser(), False, "test", "H100")
    assert typed.sizes.model_dump() == {"sw_batch_size": 3, "sampling_window_batch_size": "auto",
                                      "decode_slab_elements": "auto"}
    with pytest.raises(MedvolError, match=r"^predict.py: `sw_batch_size` is 0; expected auto or a whole number"):
        predict_request(command(**given, sw_batch_size=0), RUN)
    # A switch is true or false (`tta` also null: the model's own), never a word that Python finds true.
    for key, value, expected in (("tta", "no", "true, false or null"), ("keep_crop", 1, "true or false"),
                                 ("continue_prediction", None, "true or false")):
        with pytest.raises(MedvolError, match=rf"^`{key}` is {value!r}; expected {expected}$"):
            predict_request(command(**given, **{key: value}), RUN)
    with pytest.raises(MedvolError, match=r"^`roi` is \[8, 0, 8\]"):
        predict_request(command(roi=[8, 0, 8], **given), RUN)
