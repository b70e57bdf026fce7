"""3D VQ-GAN: EMA codebook, encoder/decoder, adversarial training."""
