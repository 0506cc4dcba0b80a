"""Host transfers prefetched through Streaming Memory (tiles.cycles.staged_host_seconds): a
call waits for the copy between the staging area and the IPU, and for the host link only
where the link takes longer than the device. Under a second."""

from __future__ import annotations

import pytest

from device_server.emulator.arch import get_target
from device_server.emulator.tiles import cycles as cyc
from device_server.emulator.tiles.replication import host_link_load, replication
from device_server.protocol import hardware

MB = 1_000_000


def test_compute_bound_call_waits_for_the_copy_only() -> None:
    t = get_target("bow")
    network = cyc.host_seconds(t, 3 * MB, 0, bytes_per_s=5.5e9, sharers=4)
    s = cyc.staged_host_seconds(t, network, 3 * MB, 0, 20e9, device_s=10e-3)
    assert s == pytest.approx(3 * MB / 20e9)
    assert s < network


def test_io_bound_call_waits_for_the_link_beyond_the_device() -> None:
    t = get_target("bow")
    network = cyc.host_seconds(t, 30 * MB, 0, bytes_per_s=5.5e9, sharers=4)
    s = cyc.staged_host_seconds(t, network, 30 * MB, 0, 20e9, device_s=1e-3)
    assert s == pytest.approx(network - 1e-3)
    assert (1e-3 + s) == pytest.approx(network)   # the call takes the link's time


def test_no_staging_area_keeps_everything_serial() -> None:
    t = get_target("ipu1")
    network = cyc.host_seconds(t, 3 * MB, 4, bytes_per_s=32e9, sharers=2)
    assert cyc.staged_host_seconds(t, network, 3 * MB, 4, 0.0, device_s=1.0) == network


@pytest.mark.parametrize("system, version, staged", [("pod16", "ipu2", True),
                                                     ("bow-pod16", "bow", True),
                                                     ("dss8440", "ipu1", False)])
def test_host_link_load_on_systems(system: str, version: str, staged: bool) -> None:
    t = get_target(version)
    rep = replication(16, system, (), t)
    serial = host_link_load(rep, 3 * MB, 4)
    overlapped = host_link_load(rep, 3 * MB, 4, device_seconds=10e-3)
    assert serial.network_seconds is None and serial.seconds > 0
    if staged:
        sm = hardware.get_system(system).streaming_memory_bytes_per_s
        assert overlapped.network_seconds == pytest.approx(serial.seconds)
        assert overlapped.seconds == pytest.approx((3 * MB + 4) / sm)
        assert overlapped.to_dict()["network_seconds"] == overlapped.network_seconds
    else:   # C2 cards: no Streaming Memory, every transfer in the call's time
        assert overlapped == serial
