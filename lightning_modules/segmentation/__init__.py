"""3D segmentation: MONAI networks, label schemes (classes or nested regions), sliding-window evaluation."""
