"""Survival and classification from 3D volumes (plus optional tabular covariates) with a MONAI 3D ResNet."""
