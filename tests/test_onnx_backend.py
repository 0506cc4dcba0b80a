"""onnx's conformance tests (``onnx.backend.test.BackendTest``) through ``tf_ipu.onnx.backend``,
for the node tests listed in tests/data/onnx_node_tests.txt (made by make_onnx_node_tests.py
from the pinned onnx) and the model tests of real architectures (``REAL``, from the light
models onnx ships). The reference is onnx's expected data, at its tolerances.

- Tests of data types no IPU has (FP8, FP4, INT4/UINT4, INT2/UINT2, E8M0) must be refused
  cleanly at prepare, naming the type (``_ListedBackend``).
- ``KNOWN_FAILURES`` are the listed tests that do not pass yet (each counts as a failure of
  the pass rate ``test_pass_rate`` states); everything else must pass.
"""

from __future__ import annotations

import re
import unittest
from pathlib import Path

import onnx.backend.test
import pytest
from onnx.backend.test.runner import BackendIsNotSupposedToImplementIt

import tf_ipu.onnx as tox
from tf_ipu.onnx.backend import TfIpuBackend
from tf_ipu.onnx.dtypes import NO_IPU_TYPES

LIST = Path(__file__).with_name("data") / "onnx_node_tests.txt"
NAMES = [line.strip() for line in LIST.read_text().splitlines() if line.strip() and not line.startswith("#")]
_NO_IPU = re.compile(r"FLOAT8|FLOAT4|INT4|INT2|E8M0", re.IGNORECASE)
NO_IPU_DTYPE = [n for n in NAMES if _NO_IPU.search(n)]
KNOWN_FAILURES = {
    "test_identity_opt": "optional values are not supported",
    "test_identity_sequence": "sequences are not supported",
    "test_split_to_sequence_1": "SplitToSequence (sequences) is not supported",
    "test_split_to_sequence_2": "SplitToSequence (sequences) is not supported",
    "test_split_to_sequence_nokeepdims": "SplitToSequence (sequences) is not supported",
}
RUN = [n for n in NAMES if n not in NO_IPU_DTYPE and n not in KNOWN_FAILURES]
#: onnx's model tests of real architectures, run offline from the light models onnx ships
#: (random weights; the expected outputs are onnx's files): coverage of whole networks.
REAL = ["test_bvlc_alexnet", "test_densenet121", "test_inception_v1", "test_inception_v2",
        "test_resnet50", "test_shufflenet", "test_squeezenet", "test_vgg19", "test_zfnet512"]


pytestmark = pytest.mark.usefixtures("onnx_server")  # conftest: the shared server


class _ListedBackend(TfIpuBackend):
    """The backend, holding the tests of data types no IPU has to a clean refusal: onnx's
    node tests name their graph after the test."""

    @classmethod
    def prepare(cls, model, device="CPU", **kwargs):
        if model.graph.name not in NO_IPU_DTYPE:
            return super().prepare(model, device, **kwargs)
        with pytest.raises(tox.UnsupportedOnnxError) as info:
            super().prepare(model, device, **kwargs)
        assert info.value.dtype in NO_IPU_TYPES and info.value.dtype in str(info.value), str(info.value)
        raise BackendIsNotSupposedToImplementIt(str(info.value))


_backend_test = onnx.backend.test.BackendTest(_ListedBackend, __name__)
_wanted = {f"{n}_cpu" for n in RUN + NO_IPU_DTYPE}
# Only the listed tests become test methods (BackendTest would add every other one, skipped).
OnnxBackendNodeModelTest = type("OnnxBackendNodeModelTest", (unittest.TestCase,), {
    name: item.func for name, item in sorted(_backend_test._test_items["NodeModel"].items()) if name in _wanted})
OnnxBackendRealModelTest = type("OnnxBackendRealModelTest", (unittest.TestCase,), {
    f"{n}_cpu": _backend_test._test_items["RealModel"][f"{n}_cpu"].func for n in REAL})


def test_the_list_is_the_pinned_onnx_s():
    """Every listed name is a node test of this onnx (regenerate the list after a bump)."""
    missing = sorted(n for n in _wanted if not hasattr(OnnxBackendNodeModelTest, n))
    assert not missing, missing[:5]


def test_pass_rate():
    """The rate this list is held to: all but KNOWN_FAILURES, out of the tests not refused
    for a data type no IPU has."""
    held = len(NAMES) - len(NO_IPU_DTYPE)
    rate = (held - len(KNOWN_FAILURES)) / held
    assert rate >= 0.98, rate
    assert set(KNOWN_FAILURES) <= set(NAMES)

