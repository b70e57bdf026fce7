"""X-ray-to-CT: a cascade of 3D diffusion stages conditioned on radiographs, with a projection-consistency loss."""
