"""medvol: train 3D medical imaging models from one Hydra command."""

__version__ = "0.1.0"
