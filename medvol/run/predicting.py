"""`predict(cfg)`: a trained model's outputs for unseen whole volumes, written like `test=true` writes them.

predict.py runs in stages, one after the other, each taking what the one before it gave, as nnU-Net's inference does:

1. the runs the command names opened and checked, each file read once (`medvol.run.trained_run`);
2. the command's values checked against the run and typed into one request (`medvol.run.predict_check`): no later
   stage reads the command's config;
3. the model that predicts built on the device: the run's, or an ensemble of folds, with its post-processing
   (`medvol.run.ensemble`);
4. the window batches and the decoder slab planned for the device's memory (`medvol.run.inference_preflight`);
5. the outputs, by what the command gives: volumes from noise (`medvol.run.noise_samples`), CTs from radiographs
   (`medvol.run.radiographs`), or every subject of the inputs predicted and written as one job
   (`medvol.run.predict_job`).
"""

from __future__ import annotations

from omegaconf import DictConfig

from medvol.core.checkpoint_read import TRUST_KEY, checkpoints_trusted
from medvol.run.ensemble import predictor
from medvol.run.inference_preflight import plan_inference
from medvol.run.noise_samples import noise_samples
from medvol.run.predict_check import autocast_for, predict_request
from medvol.run.predict_job import predict_job
from medvol.run.radiographs import radiograph_cts
from medvol.run.trained_run import open_trained_runs


def predict(cfg: DictConfig) -> dict[str, float]:
    """Predict every subject the config names and write the outputs; return the mean per-subject metrics.

    Checkpoints are read as data unless this command says `trust_checkpoints=true`; the run's own config
    never grants it."""
    with checkpoints_trusted(cfg.get(TRUST_KEY, False)):
        runs = open_trained_runs(cfg.get("ckpt_path"), cfg.get("run_dir"), cfg.get("model"))
        run = runs.first.config
        request = predict_request(cfg, run)
        model = predictor(
            runs, request.device, request.tta, request.postprocessing, request.save_probabilities,
            request.num_samples, request.from_noise, progress=True,
        )
        # The window batches and the decoder slab from the predicted peak of a call, before any subject is read (an
        # ensemble's members are called one after the other: the first stands for them).
        plan = plan_inference(model, request.sizes, request.device, request.precision, request.card, request.roi)
        if plan.named:
            # `preflight=<card>`: the plan for that card, nothing read or written.
            return {}
        plan.apply(model)
        with autocast_for(request.precision, request.device):
            if request.from_noise:
                return noise_samples(request, model)
            if request.source is not None and "xray" in model.generation_inputs():
                return radiograph_cts(request, model, run)
            return predict_job(request, model, run, runs.checkpoints, plan.sw_batch_size)
