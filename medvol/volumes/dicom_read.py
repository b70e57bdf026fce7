"""One DICOM file read by pydicom, with what reading it inflates bounded, or refused in one line.

A file in the Deflated Explicit VR Little Endian transfer syntax (1.2.840.10008.1.2.1.99) holds its data set
deflated, and pydicom inflates it whole before it parses a single element, even for the header alone
(`stop_before_pixels`): deflate reaches ratios of about 1000, so a 1 MB file asks for a GiB. Here the file meta
(group 0002, never deflated) is read first; a deflated data set is inflated in chunks, its header up to
`HEADER_BYTES` (its elements must reach the pixel data within them), the whole file up to that and the native
pixel bytes its header promises (rows x columns x samples x frames x bits), within the memory budget
(`medvol.volumes.volume_budget`); pydicom parses the inflated bytes. A file beyond its bound is refused naming the
file, the bound and the budget, before more is inflated.

Every other transfer syntax is read by pydicom as it is; a file larger than the budget is refused before it is
opened (`check_file_size`), and a file pydicom cannot parse is refused as unreadable.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import BinaryIO

import pydicom
from pydicom.charset import convert_encodings
from pydicom.dataset import Dataset, FileDataset, FileMetaDataset
from pydicom.filebase import DicomBytesIO
from pydicom.filereader import read_dataset, read_preamble
from pydicom.uid import DeflatedExplicitVRLittleEndian

from medvol.core.errors import MedvolError
from medvol.volumes.volume_budget import BUDGET_ENV, GIB, check_file_size, volume_budget_bytes

# What a header may inflate to before its pixel data: far beyond any scanner's (tens of kB, a few MB with private
# sequences or icons), far below what a bomb asks for.
HEADER_BYTES = 32 * 2**20
# Compressed bytes read per step of the inflation.
CHUNK_BYTES = 2**20
# (7FE0,0010) Pixel Data and its float and double float forms: a header read stops at the first.
PIXEL_TAGS = (0x7FE00010, 0x7FE00008, 0x7FE00009)
META_GROUP = 0x0002
# DICOM's default repertoire, where a data set names no SpecificCharacterSet.
DEFAULT_CHARSET = "ISO_IR 6"


def read_dicom(path: str | Path, header_only: bool) -> FileDataset:
    """The DICOM file at `path`: its header (`header_only`: parsing stops before the pixel data) or all of it."""
    path = Path(path)
    check_file_size(path)
    try:
        with path.open("rb") as handle:
            preamble = read_preamble(handle, False)
            meta = FileMetaDataset(
                read_dataset(handle, False, True, stop_when=lambda tag, vr, length: tag >> 16 != META_GROUP)
            )
            if meta.get("TransferSyntaxUID") == DeflatedExplicitVRLittleEndian:
                return _deflated(path, handle, preamble, meta, header_only)
        return pydicom.dcmread(path, stop_before_pixels=header_only)
    except MedvolError:
        raise
    except Exception as err:  # noqa: BLE001 - every parser failure means the same to the user
        raise MedvolError(f"{path}: unreadable DICOM file ({type(err).__name__}: {str(err)[:80]})") from err


def promised_pixel_bytes(header: Dataset) -> int:
    """The bytes of native pixel data a header promises: rows x columns x samples x frames x bits allocated."""
    values = [int(header.get(key, 1) or 1) for key in ("Rows", "Columns", "SamplesPerPixel", "NumberOfFrames")]
    return (math.prod(values) * int(header.get("BitsAllocated", 8) or 8) + 7) // 8


def _deflated(
    path: Path, handle: BinaryIO, preamble: bytes | None, meta: FileMetaDataset, header_only: bool
) -> FileDataset:
    """The deflated data set after the file meta: its header inflated up to `HEADER_BYTES`; for the whole file,
    inflated again up to that and the pixel bytes the header promises, within the budget."""
    start = handle.tell()
    dataset = _inflated_dataset(path, handle, HEADER_BYTES, True, "its header")
    if not header_only:
        pixels = promised_pixel_bytes(dataset)
        handle.seek(start)
        what = f"its header and the {pixels:,} bytes of pixels it promises"
        dataset = _inflated_dataset(path, handle, min(volume_budget_bytes(), HEADER_BYTES + pixels), False, what)
    result = FileDataset(str(path), dataset, preamble, meta, is_implicit_VR=False, is_little_endian=True)
    charset = convert_encodings(dataset.get("SpecificCharacterSet") or DEFAULT_CHARSET)
    result.set_original_encoding(False, True, charset)
    return result


def _inflated_dataset(path: Path, handle: BinaryIO, bound: int, header_only: bool, what: str) -> Dataset:
    """The data set inflated from `handle` up to `bound` bytes and parsed (up to its pixel data with
    `header_only`); refused in one line when it neither ends nor, for a header, reaches its pixels within them."""
    inflated, ended = _inflate(handle, bound)
    reached: list[int] = []

    def at_pixels(tag: int, vr: str | None, length: int) -> bool:
        reached.extend([tag] if tag in PIXEL_TAGS else [])
        return header_only and tag in PIXEL_TAGS

    dataset = None
    if ended or header_only:
        try:
            dataset = read_dataset(DicomBytesIO(inflated), False, True, stop_when=at_pixels)
        except Exception:  # noqa: BLE001 - a cut header is refused below; a whole one that fails is unreadable
            if ended:
                raise
    if dataset is None or not (ended or reached):
        raise MedvolError(
            f"{path}: its deflated data set (transfer syntax {DeflatedExplicitVRLittleEndian}) inflates beyond "
            f"{bound / 2**20:.4g} MiB, more than {what} may take (the memory budget is "
            f"{volume_budget_bytes() / GIB:.3g} GiB, a quarter of this machine's memory; {BUDGET_ENV} sets another); "
            "refused before inflating it further"
        )
    return dataset


def _inflate(handle: BinaryIO, bound: int) -> tuple[bytes, bool]:
    """(the inflated bytes, at most `bound` of them; whether the stream ended within them)."""
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)
    parts: list[bytes] = []
    size = 0
    pending = b""
    while not inflater.eof:
        pending = pending or handle.read(CHUNK_BYTES)
        if not pending:
            # A cut stream: pydicom parses what there is, as it would.
            break
        part = inflater.decompress(pending, bound + 1 - size)
        parts.append(part)
        size += len(part)
        pending = inflater.unconsumed_tail
        if size > bound:
            return b"".join(parts)[:bound], False
    return b"".join(parts), True
