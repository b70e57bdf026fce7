"""medvol: train 3D medical imaging models from one Hydra command.

Two layers live here, with the rooms (`lightning_modules`, `datamodules`, `callbacks`) between them:
`medvol.run` on top (it builds and drives the rooms), and the ground beneath every room,
`medvol.core` and `medvol.volumes`, which import nothing of the project above them.
"""

__version__ = "0.1.0"
