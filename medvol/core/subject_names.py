"""Subject ids as file names: a dataset's file (an nnU-Net `dataset.json`, a `dataset.list_file`) names its subjects,
and validation and prediction write `<subject>_seg.nii.gz`, `label_maps/<subject>.npz`; an id such as `../../x` must
never become a path.

Ids a file declares are checked where the file is read (`check_subject_id`: letters, digits, `_`, `-`, `.`, not `.`
or `..` alone, one line naming the file and the id). Every writer still makes its file names through `SubjectFiles`,
whatever the id's source (a folder's name from a file pattern may hold a space): any other character becomes `_`,
and two ids that would share a name are refused in one line rather than one overwriting the other.
"""

from __future__ import annotations

import re

from medvol.core.errors import MedvolError

MAX_SUBJECT_LENGTH = 200
_ALLOWED = re.compile(rf"[A-Za-z0-9_.-]{{1,{MAX_SUBJECT_LENGTH}}}")
_OTHER = re.compile(r"[^A-Za-z0-9_.-]")


def check_subject_id(subject: object, where: str) -> str:
    """`subject` as given where it is a plain name, else a refusal naming `where` (the file) and the id."""
    text = str(subject)
    if not _ALLOWED.fullmatch(text) or text in (".", ".."):
        raise MedvolError(
            f"{where}: subject id {text[:100]!r} is not a plain name; expected letters, digits, `_`, `-` and `.` (not "
            f"`.` or `..` alone), at most {MAX_SUBJECT_LENGTH} characters: a subject id becomes a file name"
        )
    return text


def file_stem(subject: str) -> str:
    """`subject` as a file name of the allowed characters only, never `.`, `..` or empty."""
    stem = _OTHER.sub("_", subject)[:MAX_SUBJECT_LENGTH]
    return "_" * max(1, len(stem)) if stem in ("", ".", "..") else stem


class SubjectFiles:
    """The file stems of the subjects one writer names: each id keeps its stem, two ids never share one."""

    def __init__(self) -> None:
        self._ids: dict[str, str] = {}

    def stem(self, subject: object) -> str:
        text = str(subject)
        stem = file_stem(text)
        owner = self._ids.setdefault(stem, text)
        if owner != text:
            raise MedvolError(
                f"subject ids {text!r} and {owner!r} both become the file name {stem!r}; expected subject ids that "
                "stay apart once every character but letters, digits, `_`, `-` and `.` is replaced by `_`"
            )
        return stem
