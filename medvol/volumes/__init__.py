"""The ground's volumes: NIfTI io, source grids, intensity and its inverse, the prediction writer, sliding windows, the
X-ray projector, anatomical planes; imports nothing of the project but the ground."""
