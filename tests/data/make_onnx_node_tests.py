"""Regenerates tests/data/onnx_node_tests.txt: the onnx node tests (of the pinned onnx) of the
operator families tf_ipu.onnx is held to, one name per line.

    .venv/bin/python tests/data/make_onnx_node_tests.py
"""

from __future__ import annotations

import re
from pathlib import Path

FAMILIES = (
    "conv gemm matmul relu add mul sub div softmax maxpool averagepool globalaveragepool batchnorm "
    "concat reshape transpose flatten sigmoid tanh gather layer_normalization reduce_mean reduce_sum "
    "exp log sqrt pow clip pad slice squeeze unsqueeze cast erf gelu where expand split identity "
    "leakyrelu hardsigmoid hardswish"
).split()


def main() -> None:
    import onnx
    from onnx.backend.test.loader import load_model_tests

    pattern = re.compile(r"^test_(" + "|".join(FAMILIES) + r")(_.*)?$")
    names = sorted(c.name for c in load_model_tests(kind="node") if pattern.match(c.name))
    out = Path(__file__).with_name("onnx_node_tests.txt")
    out.write_text(f"# onnx {onnx.__version__} node tests of the families in {Path(__file__).name}\n"
                   + "\n".join(names) + "\n")
    print(f"{len(names)} tests -> {out}")


if __name__ == "__main__":
    main()
