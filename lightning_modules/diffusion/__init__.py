"""The diffusion core every diffusion family derives from (`DiffusionModule`: schedule, timestep sets, prediction
algebra, samplers, EMA, per-subject noise, the walk, windowed sampling) and Fast-DDPM's `ConditionalDiffusion`
(`fast_ddpm.py`)."""
