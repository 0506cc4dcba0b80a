"""A ``DeviceClient``'s device-resident variables: written and read back by key.

    write_variables({key: array}) ── encoded (tf_ipu.transport: shared memory, inline or a
                                       streamed blob) ──WriteVariables──> the session's variables
    read_variables([key]) ──ReadVariables (output regions for the shapes last written)──> arrays

``Variables`` is one part of ``DeviceClient`` (``tf_ipu.client``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from device_server.protocol import device_pb2, dtypes
from tf_ipu.client_types import TensorSpec


class Variables:
    """Device-resident variables of a DeviceClient's session (module docstring)."""

    def write_variables(self, variables: Mapping[str, np.ndarray]) -> None:
        """Writes (creating if new) device-resident variables of the session, all at once.
        Values past the message budget are streamed first (``tf_ipu.transport``)."""
        request = device_pb2.WriteVariablesRequest(session_id=self.session_id)
        with self.data.call() as call:
            for key, value in variables.items():
                named = request.variables.add(key=key)
                call.encode(named.tensor, value, f"variable {key!r}", replaces=key)
                self._variable_specs[key] = TensorSpec(
                    dtypes.to_numpy(named.tensor.dtype), tuple(named.tensor.dims))
            self._call("WriteVariables", request, self.run_timeout)

    def read_variables(self, keys: Iterable[str]) -> dict[str, np.ndarray]:
        """Reads device-resident variables back (through shared memory, inline, or streamed,
        as ``tf_ipu.transport`` decides).

        Returns:
            key -> array (read-only views of the reply's bytes, or arrays of their own).

        Raises:
            NotFoundError: naming the first key the session does not have.
        """
        request = device_pb2.ReadVariablesRequest(session_id=self.session_id, keys=list(keys))
        with self.data.call() as call:
            for key in request.keys:
                spec = self._variable_specs.get(key)
                region = None if spec is None else call.output_region(spec.dtype, spec.shape)
                if region is not None:
                    request.regions[key].CopyFrom(region)
            reply = self._call("ReadVariables", request, self.run_timeout)
            return {v.key: call.decode(v.tensor, f"variable {v.key!r}") for v in reply.variables}
