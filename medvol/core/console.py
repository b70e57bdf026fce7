"""A quiet console and a complete train.log.

Lightning gives its loggers a handler of their own when imported before Hydra configures
logging, so their lines never reached `train.log`; here they go through Hydra's handlers like
medvol's. The console then drops third-party chatter (tips to install other products, hardware
lines, library warnings from site-packages) that `train.log` still records.
"""

from __future__ import annotations

import logging

import rich.syntax
import rich.tree
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

LIBRARY_LOGGERS = ("pytorch_lightning", "lightning_fabric", "lightning", "lightning.pytorch", "lightning.fabric")
QUIET_ON_CONSOLE = (
    "💡 Tip",
    "GPU available:",
    "TPU available:",
    "HPU available:",
    "Trainer already configured with model summary callbacks",
    "LOCAL_RANK:",
)


class ConsoleFilter(logging.Filter):
    """Drops third-party chatter from a console handler: library tips and hardware lines, library warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name == "py.warnings":
            return "site-packages" not in message
        return not (record.levelno < logging.WARNING and any(text in message for text in QUIET_ON_CONSOLE))


def quiet_console() -> None:
    """Send library logs and Python warnings through the root handlers; filter the console ones."""
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:
                logger.removeHandler(handler)
        logger.propagate = True
    logging.captureWarnings(True)
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, logging.FileHandler) and not any(isinstance(f, ConsoleFilter) for f in handler.filters):
            handler.addFilter(ConsoleFilter())


def print_config_tree(cfg: DictConfig, console: Console | None = None) -> None:
    """The composed config as a tree of groups (model, dataset, trainer, ...), each as YAML."""
    tree = rich.tree.Tree("config", guide_style="dim")
    widest = 0
    for key, value in cfg.items():
        if key == "hydra":
            continue
        branch = tree.add(str(key), style="bold")
        text = (OmegaConf.to_yaml(value, resolve=True) if OmegaConf.is_config(value) else str(value)).rstrip()
        widest = max([widest, *(len(line) for line in text.splitlines())])
        branch.add(rich.syntax.Syntax(text, "yaml", theme="ansi_dark", background_color="default"))
    # Wide enough for the longest line (plus the tree's indent): Rich would crop paths to the terminal width.
    (console or Console(width=max(Console().width, widest + 12))).print(tree)
