"""Latent diffusion on a trained VQ-GAN: the frozen first stage, exact slab decoding, generation metrics, the family."""
