"""Multi-IPU systems (device_server/protocol/hardware.py): the presets' IPUs, links and host
links; a server hosting a named system; IPUConfig.system asking for one.

References: the figures and topologies in /work/shared/ipu_arch.md (C2 card, DSS8440,
IPU-M2000, Bow-2000, POD16), checked here for what must hold whatever a figure's refinement.
"""

from __future__ import annotations

import pytest

from device_server.protocol import hardware


def test_versions_are_named_once_for_the_client_and_the_emulator():
    from device_server.emulator.arch import PRESETS, get_target
    from tf_ipu import config

    assert set(PRESETS) == set(hardware.VERSIONS)
    for alias, canonical in config.IPU_VERSIONS.items():
        assert get_target(alias).name == canonical == hardware.canonical_version(alias.upper())
        assert config.default_tiles(alias) == get_target(alias).hardware_tiles_per_ipu
    with pytest.raises(ValueError, match="Unknown IPU version 'gc3'; accepted: 'bow', 'gc2'"):
        hardware.canonical_version("gc3")


@pytest.mark.parametrize("name, ipus, version, per_host_link", [
    ("c2", 2, "ipu1", 2), ("dss8440", 16, "ipu1", 2), ("m2000", 4, "ipu2", 4),
    ("bow2000", 4, "bow", 4), ("pod16", 16, "ipu2", 4), ("bow-pod16", 16, "bow", 4),
])
def test_each_system_has_its_ipus_links_and_shared_host_links(name, ipus, version, per_host_link):
    system = hardware.get_system(name)
    assert (system.num_ipus, system.ipu_version) == (ipus, version)
    # Host links: a C2 card's two IPUs share its PCIe link, an M2000's four its gateway.
    assert all(len(h.ipus) == per_host_link for h in system.host_links)
    assert sorted(i for h in system.host_links for i in h.ipus) == list(range(ipus))
    assert all(h.bytes_per_s > 0 and h.latency_s > 0 for h in system.host_links)
    # Every IPU reaches every other over IPU-Links; a card's (machine's) pair is one hop.
    for i in range(ipus):
        assert len(system.path(0, i)) <= ipus
    assert system.link(0, 1) is not None and system.link(1, 0) is system.link(0, 1)
    assert all(link.bytes_per_s > 0 and link.latency_s > 0 for link in system.links)
    assert system.summary().startswith(f"{name}: {ipus} {system.product} IPUs")


def test_the_dss8440_is_the_launch_articles_ladder_of_c2_cards():
    """8 C2 cards of 2 GC2 each; as Graphcore's diagram of 8 C2 cards draws the links: a
    card's pair joined (2 of its 3 links), IPU i to IPU i+2 (the named assumption)."""
    dss = hardware.get_system("dss8440")
    assert [h.ipus for h in dss.host_links] == [(i, i + 1) for i in range(0, 16, 2)]
    assert dss.link(0, 1).bytes_per_s == 2 * dss.link(0, 2).bytes_per_s
    assert dss.link(0, 3) is None and dss.path(0, 3) in ([0, 1, 3], [0, 2, 3])
    assert dss.neighbours(2) == [0, 3, 4]
    assert any("ladder" in a for a in dss.assumptions)


def test_a_plain_count_of_ipus_is_linked_like_the_versions_machines():
    plain = hardware.plain_system(6, "gc200")
    assert plain.num_ipus == 6 and plain.ipu_version == "ipu2"
    assert [h.ipus for h in plain.host_links] == [(0, 1, 2, 3), (4, 5)]
    with pytest.raises(ValueError, match="Unknown system 'dgx'; accepted: bow-pod128, bow-pod16, bow-pod256"):
        hardware.get_system("dgx")


@pytest.fixture(scope="module")
def dss8440_server():
    from device_server.server import serve
    from device_server.service import ServiceConfig

    handle = serve(config=ServiceConfig(system="dss8440"))
    yield handle
    handle.stop(grace=1.0)


def test_a_server_hosting_a_system_attaches_only_its_ipus(dss8440_server):
    from tf_ipu import errors
    from tf_ipu.client import DeviceClient

    with DeviceClient(dss8440_server.address) as client:
        session = client.open_session()
        assert (session.system, session.num_ipus, session.default_ipu_version) == \
            ("dss8440", 16, "ipu1")
        with pytest.raises(errors.InvalidArgumentError,
                           match=r"hosts a dss8440 \(Dell DSS8440.*\): it has no 'ipu2' IPUs. "
                                 r"Ask for ipu_version 'ipu1'"):
            client.attach(2, "ipu2")
        with pytest.raises(errors.InvalidArgumentError,
                               match=r"17 IPUs asked for .* hosts 16 \(a dss8440: Dell DSS8440"):
            client.attach(17)
        attached = client.attach(2)
        assert attached.ipu_ids == [0, 1] and attached.ipu_version == "ipu1"
        assert attached.tiles_per_ipu == 1216


def test_ipu_config_asks_for_a_system(dss8440_server):
    import tf_ipu
    from tf_ipu import errors
    from tf_ipu.runtime import local_server_args

    cfg = tf_ipu.IPUConfig()
    with pytest.raises(ValueError, match="IPUConfig.system must be '' .* or one of bow-pod128"):
        cfg.system = "pod32"
    cfg.system = "DSS8440"
    assert cfg.system == "dss8440" and cfg.ipu_version == "ipu1"  # the system's IPUs
    assert local_server_args(cfg)[:2] == ["--system", "dss8440"]  # the embedded server's
    cfg.auto_select_ipus = 32
    with pytest.raises(ValueError, match="auto_select_ipus is 32 but the dss8440 system has "
                                         "16 IPUs"):
        cfg.check_consistency()
    cfg.auto_select_ipus = 1
    cfg.ipu_model.version = "bow"
    with pytest.raises(ValueError, match="'dss8440' has GC2 IPUs .* ipu_model.version is 'bow'"):
        cfg.check_consistency()

    rt = tf_ipu.get_runtime()
    previous = rt.config
    wrong = tf_ipu.IPUConfig()
    wrong.system = "m2000"
    wrong.server_address = dss8440_server.address
    try:
        with pytest.raises(errors.FailedPreconditionError,
                           match="IPUConfig.system is 'm2000' but the device server at .* "
                                 "hosts 'dss8440'"):
            wrong.configure_ipu_system()
        right = tf_ipu.IPUConfig()
        right.system = "dss8440"
        right.server_address = dss8440_server.address
        right.configure_ipu_system()
        assert rt.client.attachment.ipu_version == "ipu1"
    finally:
        if previous is not None:
            previous.configure_ipu_system()
