"""The fake's nvmlDeviceGetFieldValues answers a batch in one go (a plan per batch, word columns
through a memoryview): each field as it would be answered alone, in the C struct's layout, and
touching only what the driver writes."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import pynvml
import pytest

import fake_nvml
from fake_nvml.lib import _FIELD_WORDS

SCENARIO: dict[str, Any] = {
    "gpus": [{"model": "A100-SXM4-80GB", "count": 2, "nvlink_links": 12}],
    "processes": [{"pid": 7, "gpus": [0, 1], "sm_util": 60, "memory_mib": 1000}],
    "faults": [
        {"at": "1h", "until": "2h", "gpu": 1, "call": "nvmlDeviceGetTotalEccErrors", "error": "UNKNOWN"},
        {"at": "30m", "until": "3h", "gpu": 0, "nvlink_errors": {"links": [2], "crc": 3600, "replay": 36}},
    ],
}
# Power, energy, every link's state, traffic both ways and errors, ECC, violation time, a field
# the fake lacks, and a link past the last.
FIELDS = [
    (186, 0),
    (83, 0),
    *[(fid, link) for link in range(12) for fid in (165, 138, 139)],
    *[(fid, link) for link in range(12) for fid in (163, 161, 162)],
    (3, 0),
    (4, 0),
    (74, 0),
    (79, 0),
    (9999, 0),
    (165, 12),
]
LEFTOVER = 0xDEADBEEF_CAFEF00D  # what a caller's buffer may hold in a value union beforehand


@pytest.fixture
def node() -> Iterator[fake_nvml.InstalledNode]:
    installed = fake_nvml.install(SCENARIO, host=False)
    pynvml.nvmlInit()
    try:
        yield installed
    finally:
        pynvml.nvmlShutdown()
        fake_nvml.uninstall()


def ask(gpu: int, fields: list[tuple[int, int]]) -> list[tuple[int, int, int, int, int, int]]:
    """(fieldId, scopeId, timestamp, valueType, nvmlReturn, value as 64 bits) of each field."""
    batch = (pynvml.c_nvmlFieldValue_t * len(fields))()
    for item, (fid, scope) in zip(batch, fields, strict=True):
        item.fieldId, item.scopeId = fid, scope
        item.valueType = 7
        item.value.ullVal = LEFTOVER
    handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
    code = pynvml.nvmlLib.nvmlDeviceGetFieldValues(handle, ctypes.c_int(len(fields)), ctypes.byref(batch))
    assert code == pynvml.NVML_SUCCESS
    return [(f.fieldId, f.scopeId, f.timestamp, f.valueType, f.nvmlReturn, f.value.ullVal) for f in batch]


def test_the_word_layout_is_pynvmls_struct() -> None:
    struct = pynvml.c_nvmlFieldValue_t
    words = [(name, getattr(struct, name).offset // 8) for name, _type in struct._fields_]
    assert ctypes.sizeof(struct) == _FIELD_WORDS * 8
    assert words == [
        ("fieldId", 0),
        ("scopeId", 0),
        ("timestamp", 1),
        ("latencyUsec", 2),
        ("valueType", 3),
        ("nvmlReturn", 3),
        ("value", 4),
    ]
    assert (struct.scopeId.offset, struct.nvmlReturn.offset) == (4, 28)


@pytest.mark.parametrize("at_s", [0, 600, 5400, 4 * 3600])
def test_a_batch_answers_each_field_as_it_would_be_answered_alone(node: fake_nvml.InstalledNode, at_s: int) -> None:
    node.clock.advance(at_s)
    for gpu in (0, 1):
        batch = ask(gpu, FIELDS)
        assert batch == [ask(gpu, [field])[0] for field in FIELDS]
        # and again: the batch's plan, kept from the first time, gives the same
        assert ask(gpu, FIELDS) == batch


def test_only_what_the_driver_writes_is_written(node: fake_nvml.InstalledNode) -> None:
    node.clock.advance(5400)  # GPU 1's ECC call fails then
    answers = {(fid, scope): rest for fid, scope, *rest in ask(1, FIELDS)}
    _stamp, value_type, code, value = answers[(3, 0)]
    # A failed field gets its return code and time stamp; its type and value stay the caller's.
    assert (value_type, code, value) == (7, pynvml.NVML_ERROR_UNKNOWN, LEFTOVER)
    _stamp, value_type, code, value = answers[(165, 3)]
    # A 32-bit value is written over the union's low 4 bytes only, as a C uint would be.
    assert (value_type, code, value) == (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, 0, (LEFTOVER & ~0xFFFFFFFF) | 1)
    _stamp, value_type, code, value = answers[(138, 0)]
    # 60% of 20 GB/s a link for 1.5 h, in KiB.
    assert (value_type, code, value) == (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 0, int(0.6 * 20e9 * 5400 / 1024))
    assert answers[(9999, 0)][2] == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert answers[(165, 12)][2] == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert {stamp for stamp, *_rest in answers.values()} == {int((node.clock.start_epoch + 5400) * 1_000_000)}
