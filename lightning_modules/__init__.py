"""One LightningModule per model family, plus the pieces they share."""
