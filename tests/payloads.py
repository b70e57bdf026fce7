"""Files that attack the reader: a checkpoint whose unpickling runs a shell command (issue 36's payloads), a DICOM
file that inflates ~1000x (issue 46's)."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import torch
from pydicom.dataset import Dataset, FileDataset, FileMetaDataset
from pydicom.filebase import DicomBytesIO
from pydicom.filewriter import write_dataset, write_file_meta_info
from pydicom.uid import DeflatedExplicitVRLittleEndian


class RunsACommand:
    """Unpickled, it runs `touch <marker>` in a shell: what a crafted checkpoint does to `torch.load`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def crafted_checkpoint(path: Path, marker: Path, **extra) -> Path:
    """A file shaped like a Lightning checkpoint (`extra`: more keys, e.g. its model class) whose unpickling runs
    `touch marker`."""
    torch.save({"state_dict": {}, "loops": {}, **extra, "callbacks": {"x": RunsACommand(marker)}}, path)
    return path


def deflated_bomb(path: Path, header: FileDataset, inflated: int, in_pixels: bool = False) -> Path:
    """`header` (a DICOM slice, pixels dropped) written in the Deflated Explicit VR Little Endian transfer syntax,
    its data set followed by `inflated` zero bytes that deflate ~1000x: in a private element before the pixel
    data, or (`in_pixels`) as the pixel data itself. Written a chunk at a time, as an attacker would: the bytes
    are never held."""
    dataset = Dataset()
    dataset.update({element.tag: element for element in header if element.tag < 0x7FE00000})
    buffer = DicomBytesIO()
    buffer.is_little_endian, buffer.is_implicit_VR = True, False
    write_dataset(buffer, dataset)
    tag = (0x7FE0, 0x0010) if in_pixels else (0x0009, 0x1010)
    element = struct.pack("<HH2sHI", *tag, b"OB", 0, inflated)
    meta = FileMetaDataset(header.file_meta)
    meta.TransferSyntaxUID = DeflatedExplicitVRLittleEndian
    squeezer = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    with path.open("wb") as handle:
        handle.write(b"\0" * 128 + b"DICM")
        meta_buffer = DicomBytesIO()
        write_file_meta_info(meta_buffer, meta, enforce_standard=True)
        handle.write(meta_buffer.getvalue())
        handle.write(squeezer.compress(buffer.getvalue() + element))
        zeros = b"\0" * (1 << 20)
        for start in range(0, inflated, len(zeros)):
            handle.write(squeezer.compress(zeros[: min(len(zeros), inflated - start)]))
        handle.write(squeezer.flush())
    return path
