"""Files medvol writes inside an output folder (a run, a prediction folder), never through a symbolic link.

A run folder may come from someone else (a shared model, a resumed run): a `train.log` or a `tensorboard/` that is a
link to a file outside would make medvol append to or overwrite that file. Every file is opened below the folder
that owns it one folder at a time, relative to the one above (`dir_fd`) with `O_NOFOLLOW`: a link anywhere below
that folder, in place of a folder or of the file itself, is refused in one line, never followed. The owning folder
itself (and what lies above it) is the user's choice: a run kept on another disk through a link still works.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from medvol.core.errors import MedvolError

_MODES = {
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "r+": os.O_RDWR,
}


def _refusal(link: Path, root: Path) -> MedvolError:
    try:
        target = f" (-> {os.readlink(link)})"
    except OSError:
        target = ""
    return MedvolError(
        f"{link} is a symbolic link{target} inside {root}; medvol writes only inside its output folder and never "
        "through a link: replace the link by the file or folder itself"
    )


def refuse_links(folder: Path) -> None:
    """Refuse, in one line, a folder (a run to resume) that holds a symbolic link anywhere below it."""
    for current, folders, files in os.walk(folder):
        for name in sorted([*folders, *files]):
            path = Path(current) / name
            if path.is_symlink():
                raise MedvolError(
                    f"{folder} holds a symbolic link, {path} (-> {os.readlink(path)}); medvol writes only inside a run "
                    "and never through a link: replace the link by the file or folder itself"
                )


def _parts(root: Path, path: Path) -> tuple[str, ...]:
    """`path`'s names below `root`, by the path's text (a `..` that leaves `root` is refused)."""
    relative = Path(os.path.relpath(os.path.abspath(path), os.path.abspath(root)))
    if relative.parts[:1] in ((), (os.curdir,), (os.pardir,)):
        raise MedvolError(f"{path} lies outside the output folder {root}; medvol writes only inside it")
    return relative.parts


def _is_link(name: str, folder: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
    except OSError:
        return False


@contextlib.contextmanager
def _folder(root: Path, names: tuple[str, ...]) -> Iterator[int]:
    """A descriptor of `root / names...`, each folder made where missing and none a link."""
    root.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for depth, name in enumerate(names):
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                inner = os.open(name, flags, dir_fd=descriptor)
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=descriptor)
                inner = _open_below(name, flags, descriptor, root, names[: depth + 1])
            except OSError as err:
                raise _refused_or(err, name, descriptor, root, names[: depth + 1]) from None
            os.close(descriptor)
            descriptor = inner
        yield descriptor
    finally:
        os.close(descriptor)


def _open_below(name: str, flags: int, folder: int, root: Path, names: tuple[str, ...], mode: int = 0o666) -> int:
    try:
        return os.open(name, flags, mode, dir_fd=folder)
    except OSError as err:
        raise _refused_or(err, name, folder, root, names) from None


def _refused_or(err: OSError, name: str, folder: int, root: Path, names: tuple[str, ...]) -> OSError | MedvolError:
    if err.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK) and _is_link(name, folder):
        return _refusal(root.joinpath(*names), root)
    return err


def open_in(root: Path, path: Path, mode: str = "w", **text: Any) -> IO[Any]:
    """`path` (below `root`) opened for writing (`w`, `a`, `r+`, each with `b`), its folders made; a link in place
    of the file or of a folder below `root` is refused in one line. `text`: `open()`'s `encoding`, `errors`,
    `newline` for a text mode."""
    names = _parts(Path(root), Path(path))
    flags = _MODES[mode.replace("b", "")] | os.O_NOFOLLOW | os.O_CLOEXEC
    with _folder(Path(root), names[:-1]) as folder:
        descriptor = _open_below(names[-1], flags, folder, Path(root), names)
    return os.fdopen(descriptor, mode, **text)


def writable_path(root: Path, path: Path) -> Path:
    """`path` for a library that opens it by name (nibabel, Pillow, pydicom): no folder below `root` on its way and
    not `path` itself is a link (each is a file or folder of its own, or not there yet); else refused in one line.
    Nothing is made: a command refused later leaves no folder behind."""
    names = _parts(Path(root), Path(path))
    for depth in range(len(names)):
        below = Path(root).joinpath(*names[: depth + 1])
        if below.is_symlink():
            raise _refusal(below, Path(root))
        if not below.is_dir():
            break
    return Path(path)


def replace_in(root: Path, path: Path, write: Callable[[IO[Any]], None], mode: str = "w") -> Path:
    """`path` (below `root`) replaced in one step by what `write` writes into a partial file beside it (a reader
    never sees half a file); a link in place of the file or of a folder below `root` is refused, not replaced."""
    names = _parts(Path(root), Path(path))
    partial = f".{names[-1]}.{os.getpid()}.partial"
    with _folder(Path(root), names[:-1]) as folder:
        if _is_link(names[-1], folder):
            raise _refusal(Path(path), Path(root))
        flags = _MODES["w"] | os.O_NOFOLLOW | os.O_CLOEXEC
        descriptor = _open_below(partial, flags, folder, Path(root), (*names[:-1], partial))
        try:
            with os.fdopen(descriptor, mode) as handle:
                write(handle)
            os.replace(partial, names[-1], src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial, dir_fd=folder)
            raise
    return Path(path)
