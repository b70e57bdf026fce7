"""Diffusion family: noise schedules, timestep sets, prediction algebra, samplers, EMA and the Fast-DDPM module."""
