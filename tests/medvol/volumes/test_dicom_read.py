"""DICOM files read with what they inflate bounded: a deflated file reads as pydicom reads it whole, a bomb is refused
after inflating no more than its bound."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.uid import DeflatedExplicitVRLittleEndian

from medvol.core.errors import MedvolError
from medvol.volumes import dicom_read
from medvol.volumes.dicom_read import HEADER_BYTES, promised_pixel_bytes, read_dicom
from medvol.volumes.volume_budget import BUDGET_ENV, GIB
from tests.dicom_series import pydicom_file
from tests.payloads import deflated_bomb


@pytest.fixture
def deflated(tmp_path) -> Path:
    """pydicom's CT_small.dcm written again in the Deflated Explicit VR Little Endian transfer syntax, by pydicom."""
    dataset = pydicom.dcmread(pydicom_file("CT_small.dcm"))
    dataset.file_meta.TransferSyntaxUID = DeflatedExplicitVRLittleEndian
    dataset.save_as(tmp_path / "deflated.dcm", enforce_file_format=True)
    return tmp_path / "deflated.dcm"


def counted_inflation(monkeypatch) -> list[int]:
    """The bytes each `decompress` call of medvol's reader hands back, recorded."""
    handed: list[int] = []
    real = zlib.decompressobj

    class Counting:
        def __init__(self, *args):
            self.inner = real(*args)

        def decompress(self, data, max_length=0):
            out = self.inner.decompress(data, max_length)
            handed.append(len(out))
            return out

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(dicom_read.zlib, "decompressobj", Counting)
    return handed


def test_a_deflated_file_reads_as_pydicom_reads_it_whole(deflated):
    whole = pydicom.dcmread(deflated)
    header, full = read_dicom(deflated, header_only=True), read_dicom(deflated, header_only=False)
    assert header == pydicom.dcmread(deflated, stop_before_pixels=True) and full == whole
    np.testing.assert_array_equal(full.pixel_array, whole.pixel_array)
    assert full.file_meta.TransferSyntaxUID == DeflatedExplicitVRLittleEndian
    assert full.original_encoding == whole.original_encoding


def test_other_transfer_syntaxes_are_pydicoms_own_read(tmp_path):
    source = pydicom_file("CT_small.dcm")
    header, whole = read_dicom(source, header_only=True), pydicom.dcmread(source, stop_before_pixels=True)
    assert header == whole
    full = read_dicom(source, header_only=False)
    np.testing.assert_array_equal(full.pixel_array, pydicom.dcmread(source).pixel_array)
    (tmp_path / "junk.dcm").write_bytes(b"\0" * 128 + b"NOPE" + b"\xff" * 64)
    with pytest.raises(MedvolError, match=r"junk\.dcm: unreadable DICOM file \("):
        read_dicom(tmp_path / "junk.dcm", header_only=True)


@pytest.mark.parametrize("in_pixels", [False, True], ids=["before-pixels", "as-pixels"])
def test_a_bomb_is_refused_having_inflated_no_more_than_its_bound(tmp_path, monkeypatch, in_pixels):
    source = pydicom.dcmread(pydicom_file("CT_small.dcm"))
    bomb = deflated_bomb(tmp_path / "bomb.dcm", source, 512 * 2**20, in_pixels)
    handed = counted_inflation(monkeypatch)
    if in_pixels:
        assert read_dicom(bomb, header_only=True).Rows == source.Rows
        handed.clear()
        bound = HEADER_BYTES + promised_pixel_bytes(source)
        with pytest.raises(MedvolError, match=rf"more than its header and the {promised_pixel_bytes(source):,} bytes"):
            read_dicom(bomb, header_only=False)
    else:
        bound = HEADER_BYTES
        with pytest.raises(MedvolError, match=r"inflates beyond 32 MiB, more than its header may take"):
            read_dicom(bomb, header_only=True)
    # Two passes for the whole file: its header first, then the file to its bound.
    assert bound < sum(handed) <= bound + 1 + (HEADER_BYTES + 1 if in_pixels else 0)


def test_a_whole_file_inflates_no_further_than_the_budget(tmp_path, monkeypatch):
    source = pydicom.dcmread(pydicom_file("CT_small.dcm"))
    source.Rows = source.Columns = 8192
    monkeypatch.setenv(BUDGET_ENV, str(40 * 2**20 / GIB))
    bomb = deflated_bomb(tmp_path / "bomb.dcm", source, 256 * 2**20, in_pixels=True)
    with pytest.raises(MedvolError, match=r"inflates beyond 40 MiB, more than its header and the 134,217,728 bytes"):
        read_dicom(bomb, header_only=False)
