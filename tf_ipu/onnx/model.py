"""``tf_ipu.onnx.load``: an ONNX model compiled for the emulated IPU, run on numpy inputs.

    load(path | ModelProto, batch_size, input_shapes, precision, ipu_version, replicas)
      loader.read_model / prepare_model   parse, check, opset (convert < 7)
      shapes.fix_inputs                   static input shapes
      importer.import_model               IR module (per replica: its share of the batch)
      device.compile_module               Compile on the server: tile model, memory check
    OnnxModel.run({name: array})          checked inputs -> Execute -> {output name: array}
    OnnxModel.estimate                    the tile model's report (a CompileReport)

With ``replicas=R`` the batch (dimension 0 of every input) is split into R equal parts, one
per IPU; each replica slices its part on the device (``tf_ipu_replica_id``), and the outputs
come back joined along dimension 0 in replica order.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tf_ipu.onnx import device
from tf_ipu.onnx.errors import OnnxInputError, OnnxLoadError
from tf_ipu.onnx.importer import ImportedProgram, OutputSpec, import_model
from tf_ipu.onnx.loader import default_opset, prepare_model, read_model
from tf_ipu.onnx.shapes import InputSpec, fix_inputs

IPU_VERSIONS = ("ipu1", "ipu2", "bow", "ipu21", "mk1", "mk2")


def _canonical_version(v: str) -> str:
    from device_server.protocol import hardware

    for version in hardware.VERSIONS.values():
        if v == version.name or v in version.aliases:
            return version.name
    names = sorted({a for version in hardware.VERSIONS.values() for a in (version.name, *version.aliases)})
    raise ValueError(f"ipu_version {v!r} is not one of {names}.")


class OnnxModel:
    """An ONNX model imported, compiled and ready to run (make one with ``load``).

    Attributes:
        name: the model's name (file name or graph name).
        inputs: ``InputSpec``s (name, dtype, shape) that ``run`` takes, in order.
        outputs: ``OutputSpec``s of what ``run`` returns (shapes for the whole batch).
        opset: the ai.onnx opset the importer mapped (after any conversion).
        program: what the importer made (the IR module and signatures).
    """

    def __init__(self, program: ImportedProgram, name: str, opset: int, *, replicas: int,
                 ipu_version: str, server: str | None, compile_options: Mapping[str, Any],
                 system: str = "") -> None:
        self.program = program
        self.name = name
        self.opset = opset
        self.replicas = replicas
        self.inputs: list[InputSpec] = list(program.inputs)
        self.outputs: list[OutputSpec] = [
            OutputSpec(o.name, o.dtype, (o.shape[0] * replicas, *o.shape[1:]) if replicas > 1 and o.shape else
                       ((replicas,) if replicas > 1 else o.shape))
            for o in program.outputs]
        self.system = system
        self.address = device.resolve_address(server, system)
        self._session = device.session(self.address, ipu_version, replicas, system)
        started = time.perf_counter()
        self._compiled = device.compile_module(self._session, program.module, replicas, dict(compile_options))
        self.compile_seconds = time.perf_counter() - started
        self._estimate: Any = None

    def __repr__(self) -> str:
        ins = ", ".join(repr(s) for s in self.inputs)
        return f"OnnxModel({self.name!r}, opset {self.opset}, inputs [{ins}], replicas={self.replicas})"

    @property
    def ipu_version(self) -> str:
        return self._session.ipu_version

    @property
    def estimate(self) -> Any:
        """The tile model's estimate of one run (``tf_ipu.runtime.CompileReport``, as Keras
        programs get: ``summary()``, ``save_html(path)``, ``details``)."""
        if self._estimate is None:
            import json

            from tf_ipu.runtime import IPU_VERSIONS as names
            from tf_ipu.runtime import CompileReport

            e = self._compiled.estimate
            details = json.loads(e.json) if e.json else {}
            digest = hashlib.sha256(self.program.module.SerializeToString()).hexdigest()[:12]
            self._estimate = CompileReport(
                name=f"onnx:{self.name}", digest=digest, ipu_version=names.get(e.ipu_version, e.ipu_version),
                tiles_per_ipu=e.tiles_per_ipu, cycles=int(e.cycles), seconds=float(e.seconds),
                peak_tile_bytes=int(e.peak_tile_bytes), tile_bytes_limit=int(e.tile_bytes_limit),
                total_bytes=int(e.total_bytes), fits=None if e.fits is None else bool(e.fits), cache_hit=self._compiled.cache_hit,
                compile_seconds=float(self._compiled.compile_seconds), details=details,
                data_path=self._session.client.data.describe())
        return self._estimate

    def _check(self, feeds: Mapping[str, Any]) -> list[np.ndarray]:
        if not isinstance(feeds, Mapping):
            raise OnnxInputError(f"run() takes a dict of input name -> array, not {type(feeds).__name__}.")
        names = [s.name for s in self.inputs]
        unknown = [k for k in feeds if k not in names]
        if unknown:
            raise OnnxInputError(f"Model {self.name!r} has no input(s) {unknown}; its inputs are {names}.")
        missing = [n for n in names if n not in feeds]
        if missing:
            raise OnnxInputError(f"Model {self.name!r}: input(s) {missing} missing; it takes {self.inputs}.")
        arrays = []
        for spec in self.inputs:
            a = np.asarray(feeds[spec.name])
            if a.dtype != spec.dtype:
                raise OnnxInputError(f"Model {self.name!r}: input {spec.name!r} is {a.dtype}; the model "
                                     f"takes {spec.dtype} (convert it with .astype(np.{spec.dtype}))." )
            if tuple(a.shape) != spec.shape:
                raise OnnxInputError(f"Model {self.name!r}: input {spec.name!r} has shape {list(a.shape)}; "
                                     f"the model was compiled for {list(spec.shape)} (load it with "
                                     "another batch_size= or input_shapes= for other shapes).")
            arrays.append(np.asarray(a, order="C"))
        return arrays

    def run(self, feeds: Mapping[str, Any], output_names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Runs the model on the emulated IPU(s).

        Args:
            feeds: input name -> array (dtype and shape as ``inputs`` say).
            output_names: the outputs wanted (all by default).

        Returns:
            output name -> array.

        Raises:
            OnnxInputError: a missing or unknown input, a wrong dtype or shape.
        """
        arrays = self._check(feeds)
        outs = device.execute(self._session, self._compiled.executable_id, arrays)
        result = {}
        for spec, o in zip(self.outputs, outs, strict=True):
            if self.replicas > 1 and o.ndim >= 2:
                o = o.reshape(spec.shape)  # [R, B/R, ...] -> [B, ...], replica order
            result[spec.name] = o
        if output_names is not None:
            missing = [n for n in output_names if n not in result]
            if missing:
                raise OnnxInputError(f"Model {self.name!r} has no output(s) {missing}; its outputs are "
                                     f"{list(result)}.")
            return {n: result[n] for n in output_names}
        return result


def load(model: Any, batch_size: int | None = None, input_shapes: Mapping[str, Any] | None = None,
         precision: str = "fp32", ipu_version: str | None = None, replicas: int = 1, *,
         system: str | None = None, input_values: Mapping[str, np.ndarray] | None = None,
         server: str | None = None, fault_inject_opcode: str = "",
         allow_out_of_memory: bool = False) -> OnnxModel:
    """Loads an ONNX model and compiles it for the emulated IPU.

    Args:
        model: a path to an ``.onnx`` file, its bytes, or an ``onnx.ModelProto``.
        batch_size: the size of a symbolic leading dimension of the inputs (the whole batch,
            split over ``replicas``).
        input_shapes: input name -> shape, or symbolic dimension name -> size (e.g.
            ``{"sequence": 128}``), for the other symbolic dimensions.
        precision: ``"fp32"``, or ``"fp16"`` (float weights and arithmetic in FP16; inputs
            and outputs keep their declared types).
        ipu_version: ``"ipu1"``, ``"ipu2"``, ``"bow"`` (aliases as IPUConfig takes them);
            default: the system's, else ``"ipu2"``.
        replicas: IPUs running the model at once, each on its share of the batch.
        system: a named system whose IPUs run the replicas (``"c2"``: a C2 card's two GC2
            IPUs; ``device_server.protocol.hardware.SYSTEMS``). The server must host it;
            without ``server=`` (or a default server), one hosting it alone is started.
        input_values: inputs whose values are fixed at compile time (e.g. a shape given to
            Reshape as a model input); ``run`` then takes them no more.
        server: ``host:port`` of a device server (default: see ``tf_ipu.onnx.device``).
        fault_inject_opcode: perturb every result of this IR opcode (a test switch).
        allow_out_of_memory: compile even if the tile model says it does not fit.

    Raises:
        OnnxLoadError: malformed/truncated file, opset out of range, unknown dimensions.
        UnsupportedOnnxError: an operator, attribute or data type the importer does not map
            (naming node, op_type, domain and opset).
        tf_ipu.errors.DeviceError: the server refused the program (e.g. OutOfMemoryError).

    Example:
        >>> m = tf_ipu.onnx.load("mobilenet.onnx", batch_size=8, ipu_version="ipu1")
        >>> y = m.run({"input": x})["output"]
        >>> print(m.estimate.summary())
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, not {replicas}.")
    system_name = ""
    if system:
        from device_server.protocol import hardware

        spec = hardware.get_system(system)  # ValueError naming the accepted names
        system_name = spec.name
        if ipu_version is not None and _canonical_version(ipu_version) != spec.ipu_version:
            raise ValueError(f"system {spec.name!r} ({spec.description}) has {spec.ipu_version} IPUs, "
                             f"not {ipu_version!r}.")
        if replicas > spec.num_ipus:
            raise ValueError(f"replicas={replicas}: system {spec.name!r} has {spec.num_ipus} IPUs.")
        ipu_version = spec.ipu_version
    version = _canonical_version(ipu_version or "ipu2")
    proto, name = read_model(model)
    proto = prepare_model(proto, repr(name))
    specs = fix_inputs(proto.graph, batch_size, input_shapes)
    values = dict(input_values or {})
    unknown = [k for k in values if k not in {s.name for s in specs}]
    if unknown:
        raise OnnxLoadError(f"input_values names {unknown}, which are not inputs of the model.")
    if replicas > 1:
        for s in specs:
            if s.name in values:
                continue
            if not s.shape or s.shape[0] % replicas:
                raise OnnxLoadError(
                    f"replicas={replicas}: input {s.name!r} of shape {list(s.shape)} has no leading "
                    f"(batch) dimension divisible by {replicas}.")
    per_replica = [InputSpec(s.name, s.dtype, (s.shape[0] // replicas, *s.shape[1:]))
                   if replicas > 1 and s.name not in values else s for s in specs]
    program = import_model(proto, per_replica, precision=precision, input_values=values,
                           replicas=replicas, name=name, entry_specs=specs)
    options: dict[str, Any] = {}
    if fault_inject_opcode:
        options["fault_inject_opcode"] = fault_inject_opcode
    if allow_out_of_memory:
        options["allow_out_of_memory"] = True
    return OnnxModel(program, name, default_opset(proto), replicas=replicas, ipu_version=version,
                     server=server, compile_options=options, system=system_name)


__all__ = ["OnnxModel", "load"]
