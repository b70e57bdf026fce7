"""Where volumes come from: NIfTI folders, BraTS, CSV tables, patches, X-ray/CT pairs, synthetic phantoms."""
