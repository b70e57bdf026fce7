"""A quiet console and complete log files (train.log, predict.log).

Lightning gives its loggers a handler of their own when imported before Hydra configures
logging, so their lines never reached `train.log`; here they go through Hydra's handlers like
medvol's. The console then drops third-party chatter (tips to install other products, hardware
lines, library warnings from site-packages, other libraries' INFO lines) that `train.log` still records.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.text import Text

from medvol.core.errors import MedvolError
from medvol.core.run_files import open_in

LIBRARY_LOGGERS = ("pytorch_lightning", "lightning_fabric", "lightning", "lightning.pytorch", "lightning.fabric")
QUIET_ON_CONSOLE = (
    "💡 Tip",
    "GPU available:",
    "TPU available:",
    "HPU available:",
    "Trainer already configured with model summary callbacks",
    "LOCAL_RANK:",
)
# Loggers whose warnings are chatter on medvol's console: MONAI's loader builds a GPU DICOM reader medvol never uses
# and warns, at every loader, that its decoder is missing (a refused input's one line would come second).
QUIET_LOGGERS = ("monai.data.nvimgcodec_pydicom_plugin",)
# The loggers whose INFO lines the console shows: medvol's, Hydra's and Lightning's (less `QUIET_ON_CONSOLE`). Every
# other library's INFO lines (highdicom's nine per DICOM-SEG written, pydicom's plugin notes, ...) go to the log only.
CONSOLE_INFO_LOGGERS = ("medvol", "hydra", "root", "__main__", *LIBRARY_LOGGERS)


class ConsoleFilter(logging.Filter):
    """Drops third-party chatter from a console handler: library tips and hardware lines, library warnings, the INFO
    lines of libraries other than medvol's, Hydra's and Lightning's; and medvol's lines meant for the log file only."""

    def filter(self, record: logging.LogRecord) -> bool:
        # A record logged with `extra={"file_only": True}` is for the log file (the per-epoch line under a Rich bar).
        if getattr(record, "file_only", False):
            return False
        message = record.getMessage()
        if record.name == "py.warnings":
            return "site-packages" not in message
        if record.name in QUIET_LOGGERS and record.levelno < logging.ERROR:
            return False
        if record.levelno >= logging.WARNING:
            return True
        if not any(record.name == name or record.name.startswith(f"{name}.") for name in CONSOLE_INFO_LOGGERS):
            return False
        return not any(text in message for text in QUIET_ON_CONSOLE)


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
        if not isinstance(handler, logging.FileHandler) and not any(
            isinstance(f, ConsoleFilter) for f in handler.filters
        ):
            handler.addFilter(ConsoleFilter())


LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


class LogFile(logging.FileHandler):
    """A log file (`train.log` through Hydra's `job_logging`, `predict.log`) opened with its folder at the first
    record where delayed (a command that logs nothing leaves no file behind), and never through a link in its place
    (`medvol.core.run_files`): a run folder sent by someone else cannot make medvol append to a file outside."""

    def _open(self):  # type: ignore[no-untyped-def]
        path = Path(self.baseFilename)
        return open_in(path.parent, path, self.mode, encoding=self.encoding, errors=self.errors)


@contextlib.contextmanager
def log_file(path: Path) -> Iterator[None]:
    """Every log record and Python warning, library ones included, also appended to `path` while inside: the
    console drops library warnings (`ConsoleFilter`), the file keeps them. A command refused inside (a
    `MedvolError`) takes back the file and folder it made: a refusal leaves nothing behind."""
    made = [p for p in (path, path.parent) if not p.exists()]
    handler = LogFile(path, mode="a", delay=True)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(min(level, logging.INFO))
    # Off, then on: whoever replaced `warnings.showwarning` since the last capture (a test harness's recorder)
    # would keep the warnings, as `captureWarnings(True)` alone does nothing when it believes it is on.
    logging.captureWarnings(False)
    logging.captureWarnings(True)
    try:
        yield
    except MedvolError:
        handler.close()
        for made_path in made:
            if made_path.is_file():
                made_path.unlink()
            elif made_path.is_dir() and not any(made_path.iterdir()):
                made_path.rmdir()
        raise
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        handler.close()


def flow_item(key: str, value: Any) -> str:
    """`key: value` as an entry of a flow-style YAML mapping: `downsample: [4, 4, 4]`,
    `filename: 'epoch{epoch:03d}'`."""
    return yaml.safe_dump({key: value}, default_flow_style=True, width=float("inf"), sort_keys=False).strip()[1:-1]


def _pack(items: list[str], width: int, indent: str = "") -> list[str]:
    """`items` joined by `, ` into lines of at most `width` characters; an item is never split."""
    lines: list[str] = []
    for i, item in enumerate(items):
        text = item + ("," if i < len(items) - 1 else "")
        if lines and len(lines[-1]) + 1 + len(text) <= width:
            lines[-1] += " " + text
        else:
            lines.append((indent if lines else "") + text)
    return lines


def _block(mapping: dict[str, Any], width: int) -> list[str]:
    """A mapping's scalars and lists packed into lines, then each nested mapping from a line of its own."""
    lines = _pack([flow_item(k, v) for k, v in mapping.items() if not isinstance(v, dict)], width)
    for key, value in mapping.items():
        if isinstance(value, dict):
            inner = [flow_item(k, v) for k, v in value.items()] or [""]
            inner[0] = f"{key}: {{{inner[0]}"
            inner[-1] += "}"
            if lines:
                lines[-1] += ","
            lines += _pack(inner, width, indent="  ")
    return lines or [""]


def config_blocks(cfg: DictConfig, width: int) -> list[tuple[str, list[str]]]:
    """(name, lines) per top-level group, resolved; the top-level values come first, under `config`.

    Each block is the body of a flow-style YAML mapping (`optimizer: {_target_: torch.optim.Adam, ...}`),
    so `{` + its lines + `}` reads back as the group's resolved config.
    """
    container = {
        str(k): OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
        for k in cfg if k != "hydra"
    }
    roots = {k: v for k, v in container.items() if not isinstance(v, dict)}
    groups = [(k, _block(v, width)) for k, v in container.items() if isinstance(v, dict)]
    return [("config", _block(roots, width))] + groups if roots else groups


def print_config_tree(cfg: DictConfig, console: Console | None = None) -> None:
    """The composed config, resolved, one block per top-level group (model, dataset, trainer, ...).

    The group's name stands in the left column, its values in flow-style YAML on the right, wrapped
    to the console's width (a longer value keeps its line rather than being cut).
    """
    console = console or Console()
    groups = [str(k) for k in cfg if k != "hydra" and OmegaConf.is_dict(cfg[k])]
    label_width = 2 + max(len(name) for name in ["config", *groups])
    for name, lines in config_blocks(cfg, max(40, console.width - label_width)):
        for i, line in enumerate(lines):
            text = Text(f"{name if i == 0 else '':<{label_width}}", style="bold" if i == 0 else "")
            text.append(line)
            console.print(text, soft_wrap=True, highlight=False)
