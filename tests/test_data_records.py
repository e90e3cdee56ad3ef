"""Sample records and schemas (rapydli/data/records.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rapydli.data.records import decode, encode, infer_schema
from rapydli.errors import DataError


def test_round_trip_keeps_container_kinds_and_dtypes() -> None:
    sample = [torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), np.arange(3, dtype=">i4"), True, 2.5, "é", b"\x00"]
    schema = infer_schema(sample)
    back = decode(encode(sample, schema, "s"), schema, "s")
    assert isinstance(back, list) and back[0].dtype == torch.bfloat16 and torch.equal(back[0], sample[0])
    assert back[1].dtype == np.dtype(">i4") and np.array_equal(back[1], sample[1])
    assert back[2:] == [True, 2.5, "é", b"\x00"]
    assert decode(encode(7, infer_schema(7), "s"), infer_schema(7), "s") == 7


def test_unsupported_kinds_and_foreign_records_are_data_errors() -> None:
    with pytest.raises(DataError, match="type object"):
        infer_schema((object(),))
    schema = infer_schema((1,))
    with pytest.raises(DataError, match="key k is not a RaPyDLI record"):
        decode(b"XXXX" + bytes(20), schema, "key k")
    with pytest.raises(DataError, match="key k is truncated"):
        decode(b"RPD", schema, "key k")
    with pytest.raises(DataError, match="does not match the store's schema: 1 fields, the schema has 2"):
        decode(encode((1,), schema, "s"), infer_schema((1, 2)), "s")


def test_decode_without_copy_returns_views_of_the_record() -> None:
    sample = (torch.arange(4, dtype=torch.float32), np.arange(3))
    schema = infer_schema(sample)
    record = bytearray(encode(sample, schema, "s"))
    back = decode(memoryview(record), schema, "s", check=False, copy=False)
    assert torch.equal(back[0], sample[0]) and np.array_equal(back[1], sample[1])
    record[-1] ^= 0xFF  # the views see the change; check=True catches it
    assert back[1][-1] != 2
    with pytest.raises(DataError, match="corrupt"):
        decode(bytes(record), schema, "s")
