"""The ground's plumbing: errors, config building, checkpoint io, process groups, batch-norm sync, logging helpers;
imports nothing of the project but the ground."""
