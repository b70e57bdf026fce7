"""`torch.compile` of the networks a family compiles (`speedups.compile`): no graph breaks, and the compiled training
step equal to the eager one, on the CPU.

A graph break splits a compiled network into pieces with eager Python between them: each piece is a kernel launch
or more and a place where the host may wait (issue 61). `torch._dynamo.explain` traces each network as
`model.compile` would and counts the breaks; the VQ-GAN compiles its encoder, decoder and both discriminators
(`VQGAN.accelerate`), the survival and classification families their network (`OutcomeModule`).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo

from lightning_modules.vqgan.vqgan import VQGAN, random_slices

TINY_VQGAN = dict(n_hiddens=8, n_codes=32, disc_channels=8, disc_layers=2, ssim_kernel_size=5)


COMPILED = ("encoder", "decoder", "image_discriminator", "video_discriminator")


def tiny_vqgan(**settings) -> VQGAN:
    torch.manual_seed(0)
    return VQGAN(**{**TINY_VQGAN, **settings}).train()


def volumes(batch: int = 2, size: int = 16) -> torch.Tensor:
    return torch.rand(batch, 1, size, size, size, generator=torch.Generator().manual_seed(1)) * 2 - 1


def vqgan_networks(model: VQGAN, x: torch.Tensor) -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    """The networks `VQGAN.accelerate` compiles, each with an input of the training step's shape."""
    latent = model.encoder(x)
    frames = random_slices(x, torch.zeros(x.shape[0], dtype=torch.long))
    return {"encoder": (model.encoder, x), "decoder": (model.decoder, latent.detach()),
            "image_discriminator": (model.image_discriminator, frames),
            "video_discriminator": (model.video_discriminator, x)}


def graph_breaks(network: torch.nn.Module, *inputs: torch.Tensor) -> list[str]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(network)(*inputs)
    return [str(reason.reason) for reason in explained.break_reasons] or (
        [f"{explained.graph_break_count} break(s)"] if explained.graph_break_count else [])


@pytest.mark.parametrize("name", COMPILED)
def test_the_vqgans_compiled_networks_trace_without_a_graph_break(name):
    model = tiny_vqgan()
    network, x = vqgan_networks(model, volumes())[name]
    assert graph_breaks(network, x) == []


def one_step(model: VQGAN, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """`VQGAN.training_step`'s order without Lightning: the losses, the discriminators' update, the generator's."""
    opt_ae, opt_disc = model.configure_optimizers()
    torch.manual_seed(2)
    step = model.gan_losses(x, True)
    step.discriminator_loss.backward(inputs=model.discriminator_parameters())
    opt_disc.step()
    step.generator_objective.backward()
    opt_ae.step()
    values = {name: value.detach() for name, value in step.terms.items()}
    values["disc_loss"] = step.discriminator_loss.detach()
    values.update({f"weight {name}": p.detach() for name, p in model.named_parameters()})
    return values


def test_the_compiled_vqgan_step_equals_the_eager_step(monkeypatch):
    eager = tiny_vqgan(compile=True)
    x = volumes()
    with torch.no_grad():
        eager.codebook._initialise(eager.encoder(x).movedim(1, -1).reshape(-1, eager.codebook.embedding_dim))
    compiled = copy.deepcopy(eager)
    # `accelerate` compiles on a CUDA device only. Here its graphs run through AOT autograd without inductor's code
    # generation: torch 2.13's CPU inductor fails to lower the discriminators' convolution backward ("Exponent must
    # be non-negative"), and inductor's CUDA kernels are the GPU round's to compare (`vqgan-compiled`).
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self: compile_module(self, backend="aot_eager"))
    compiled.accelerate(torch.device("cuda"))
    assert all(getattr(compiled, name)._compiled_call_impl is not None for name in COMPILED)
    expected, got = one_step(eager, x), one_step(compiled, x)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


# The survival and classification families compile their network when `model.compile` is on (experiment=mace_survival):
# a 3D ResNet whose pooled features are joined with the standardised covariates (`ImageCovariateNet`).
OUTCOME_NETWORKS = {"survival": dict(outputs=1, num_covariates=3), "classifier": dict(outputs=3, num_covariates=0)}
OUTCOME_MODULES = {"survival": ("survival", "SurvivalModel", dict(num_covariates=3)),
                   "classifier": ("classifier", "ClassifierModel", dict(num_classes=3))}


def outcome_network(kind: str):
    from lightning_modules.discriminative.fusion_net import ImageCovariateNet

    torch.manual_seed(0)
    net = ImageCovariateNet(backbone="resnet10", widen_factor=0.25, **OUTCOME_NETWORKS[kind]).train()
    if net.covariates is not None:
        net.covariates.fit(torch.randn(16, 3, generator=torch.Generator().manual_seed(3)) * 5 + 40)
    return net


def outcome_inputs(net) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(4)
    image = torch.rand(2, 1, 16, 16, 16, generator=generator)
    return (image,) if net.covariates is None else (image, torch.randn(2, 3, generator=generator) * 5 + 40)


@pytest.mark.parametrize("kind", OUTCOME_NETWORKS)
def test_the_outcome_families_compiled_network_traces_without_a_graph_break(kind):
    net = outcome_network(kind)
    assert graph_breaks(net, *outcome_inputs(net)) == []


@pytest.mark.parametrize("kind", OUTCOME_NETWORKS)
def test_the_compiled_outcome_step_equals_the_eager_step(kind, monkeypatch):
    """The family's module with `compile=True` compiles its network in place; its step (forward, loss, backward,
    Adam) equals the eager network's (AOT autograd without inductor's code generation, as for the VQ-GAN above)."""
    import importlib

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self: compile_module(self, backend="aot_eager"))
    file, name, settings = OUTCOME_MODULES[kind]
    family = getattr(importlib.import_module(f"lightning_modules.discriminative.{file}"), name)
    compiled = family(backbone="resnet10", widen_factor=0.25, compile=True, **settings)
    assert compiled.net._compiled_call_impl is not None
    eager = outcome_network(kind)
    compiled.net.load_state_dict(eager.state_dict())
    inputs = outcome_inputs(eager)

    def step(net) -> dict[str, torch.Tensor]:
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
        out = net(*inputs)
        loss = out.float().pow(2).mean() + out.float().mean()
        loss.backward()
        optimizer.step()
        return {"out": out.detach(), **{name: p.detach() for name, p in net.named_parameters()}}

    expected, got = step(eager), step(compiled.net)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
