"""What a ``DeviceClient``'s calls take and return: plain frozen data, no gRPC.

    DeviceClient.compile ----> CompiledProgram (parameters, outputs: TensorSpec; estimate: Estimate)
    DeviceClient.open_session -> SessionInfo      DeviceClient.attach -> Attachment
    DeviceClient.execute <---- bindings: arrays, or VariableRef (a resident variable, by key)

Every name here is importable from ``tf_ipu.client`` too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from device_server.protocol import device_pb2, dtypes

__all__ = ["Attachment", "CompiledProgram", "Estimate", "SessionInfo", "TensorSpec", "VariableRef"]


@dataclass(frozen=True)
class VariableRef:
    """Binds an entry parameter to a device-resident variable of the session, by key."""

    key: str


@dataclass(frozen=True)
class TensorSpec:
    """dtype and shape of one entry parameter or output."""

    dtype: np.dtype
    shape: tuple[int, ...]

    def __repr__(self) -> str:
        return f"TensorSpec({self.dtype}, {list(self.shape)})"


@dataclass(frozen=True)
class Estimate:
    """The emulator's first estimate for one execution of a program (see device.proto).

    ``json`` is the full report; ``report`` parses it. ``fits`` is None when the fit is
    unknown (the tile model failed: the report's ``failure`` says where); a program over its
    tiles within the tile model's margin has ``fits`` False and ``report["within_margin"]``.
    """

    ipu_version: str
    tiles_per_ipu: int
    clock_hz: float
    cycles: int
    seconds: float
    peak_tile_bytes: int
    tile_bytes_limit: int
    total_bytes: int
    fits: bool | None
    json: str = ""

    @property
    def report(self) -> dict[str, Any]:
        """The full report as a dict ({} if the server sent none)."""
        return json.loads(self.json) if self.json else {}


@dataclass(frozen=True)
class CompiledProgram:
    """What Compile returned.

    Attributes:
        executable_id: handle valid in this client's session only.
        cache_hit: the server had it compiled already.
        parameters, outputs: specs of the entry parameters and flattened outputs.
        aliases: output index -> parameter number whose new value the output carries.
        estimate: the emulator's estimate.
        compile_seconds: server-side compile time (0 for a cache hit).
    """

    executable_id: str
    cache_hit: bool
    parameters: list[TensorSpec]
    outputs: list[TensorSpec]
    aliases: dict[int, int]
    estimate: Estimate
    compile_seconds: float


@dataclass(frozen=True)
class SessionInfo:
    """What OpenSession returned."""

    session_id: str
    server_version: str
    default_ipu_version: str
    num_ipus: int
    free_ipus: int
    max_message_bytes: int
    lease_seconds: float
    max_session_bytes: int = 0  # 0: no limit
    unix_socket: str = ""       # where the server also listens, for clients on its machine
    system: str = ""            # the named system it hosts ("" for a plain count of IPUs)
    connection_lease: bool = False  # kept while this client's connection is up


@dataclass(frozen=True)
class Attachment:
    """What AttachIpus returned."""

    ipu_ids: list[int]
    ipu_version: str
    tiles_per_ipu: int


def _count(dims: Iterable[int]) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _spec(s: device_pb2.TensorSpec) -> TensorSpec:
    return TensorSpec(dtypes.to_numpy(s.dtype), tuple(int(d) for d in s.dims))
