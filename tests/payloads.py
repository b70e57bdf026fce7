"""Files that attack the reader: a checkpoint whose unpickling runs a shell command (issue 36's payloads); a DICOM
file that inflates ~1000x and NIfTI files of promises, written without holding what they promise (issue 46's)."""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from pathlib import Path

import nibabel as nib
import numpy as np
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
    its data set followed by `inflated` (at least 1 MiB) zero bytes that deflate ~1000x: in a private element
    before the pixel data, or (`in_pixels`) as the pixel data itself. The zeros are never held."""
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
    chunk = 1 << 20
    with path.open("wb") as handle:
        handle.write(b"\0" * 128 + b"DICM")
        meta_buffer = DicomBytesIO()
        write_file_meta_info(meta_buffer, meta, enforce_standard=True)
        handle.write(meta_buffer.getvalue())
        handle.write(squeezer.compress(buffer.getvalue() + element) + squeezer.flush(zlib.Z_FULL_FLUSH))
        # A full flush forgets the history: each MiB of zeros deflates to the same bytes, written again and again.
        block = squeezer.compress(b"\0" * chunk) + squeezer.flush(zlib.Z_FULL_FLUSH)
        handle.write(block * (inflated // chunk - 1))
        handle.write(squeezer.compress(b"\0" * (inflated % chunk)) + squeezer.flush())
    return path


def streamed_nifti(
    path: Path, shape: tuple[int, ...], dtype, zooms=(1.0, 1.0, 1.0), trailing: int = 0, voxels: bool = True
) -> Path:
    """A .nii.gz of zero voxels whose header says `shape`, `dtype` and `zooms` mm, followed by `trailing` more zero
    bytes in the same gzip stream (a bomb behind a modest header); without `voxels`, the header alone. The zeros
    are one small gzip member repeated (a reader inflates them as one stream): never held, quick to write."""
    header = nib.Nifti1Header()
    header.set_data_shape(shape)
    header.set_data_dtype(dtype)
    header.set_qform(np.diag([*zooms, 1.0]), code=1)
    header.set_sform(np.diag([*zooms, 1.0]), code=1)
    # A single-file NIfTI's voxels start after the header and four bytes saying it has no extensions.
    header.set_data_offset(header.sizeof_hdr + 4)
    path.parent.mkdir(parents=True, exist_ok=True)
    zeros = (int(np.prod(shape)) * np.dtype(dtype).itemsize if voxels else 0) + trailing
    chunk = 1 << 20
    member = gzip.compress(b"\0" * chunk)
    with path.open("wb") as handle:
        handle.write(gzip.compress(header.binaryblock + b"\0" * 4))
        for _ in range(zeros // chunk):
            handle.write(member)
        handle.write(gzip.compress(b"\0" * (zeros % chunk)))
    return path


def deflated_checkpoint(path: Path, inflated: int) -> Path:
    """A torch zip checkpoint (`state_dict.w`, float32) whose one tensor record holds `inflated` zero bytes stored
    deflated (~230x: 2 GiB in 9 MB), its pickle saying the tensor is that large. torch.save stores records
    uncompressed; this one is written record by record, the zeros streamed a MiB at a time and never held."""
    import io
    import zipfile

    marker = 123_457
    genuine = io.BytesIO()
    torch.save({"state_dict": {"w": torch.zeros(marker)}, "loops": {}}, genuine)
    source = zipfile.ZipFile(genuine)
    count = struct.pack("<i", marker)
    with zipfile.ZipFile(path, "w") as out:
        for info in source.infolist():
            if info.filename.endswith("/data/0"):
                record = zipfile.ZipInfo(info.filename)
                record.compress_type, record._compresslevel = zipfile.ZIP_DEFLATED, 1
                chunk = bytes(1 << 20)
                with out.open(record, "w", force_zip64=True) as handle:
                    for _ in range(inflated // len(chunk)):
                        handle.write(chunk)
                    handle.write(bytes(inflated % len(chunk)))
                continue
            data = source.read(info)
            if info.filename.endswith("/data.pkl"):
                # The element count, in the storage's key and the tensor's size (pickle's 4-byte BININT).
                data = data.replace(b"J" + count, b"J" + struct.pack("<i", inflated // 4))
            out.writestr(info, data)
    return path


def legacy_checkpoint(path: Path, value: dict) -> Path:
    """`value` saved in PyTorch's pre-1.6 format (a pickle followed by raw storages, no zip)."""
    torch.save(value, path, _use_new_zipfile_serialization=False)
    return path


def nested_json(path: Path, depth: int, leaf: str = "0") -> Path:
    """A JSON file of lists `depth` deep around `leaf` (a few hundred kB for 100,000)."""
    path.write_text("[" * depth + leaf + "]" * depth)
    return path


def long_integer(digits: int) -> str:
    """An integer of `digits` digits, as JSON or YAML writes it (Python parses at most 4300 by default)."""
    return "9" * digits
