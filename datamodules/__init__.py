"""LightningDataModules, datasets, transforms, caching and data checks."""
