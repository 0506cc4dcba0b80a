"""availableMemoryProportion against Graphcore's available-memory tech note: ResNeXt-50 32x4d
inference in FP32 at batch 20 on a Mk2 IPU runs at 0.35 and runs out of memory at 0.8
(graphcore/examples tutorials/tech_notes_code/available_memory: pytorch_demo.py and its tests).
Full size, estimate only (about 5 s per proportion on this machine)."""

from __future__ import annotations

from typing import Any

import pytest

_TILE = 638_976  # GC200 tile memory


@pytest.fixture(scope="module")
def resnext50_peaks() -> dict[float, Any]:
    """The estimates of ResNeXt-50 32x4d inference, batch 20, FP32, ipu2, at 0.35 and 0.8."""
    import tf_ipu
    from tf_ipu.models.resnext import resnext

    model = resnext(depth=50)
    return {p: tf_ipu.estimate(model, 20, ipu_version="ipu2", available_memory_proportion=p)
            for p in (0.35, 0.8)}


def test_resnext50_fits_at_0_35_and_uses_more_temporaries_when_allowed(
        resnext50_peaks: dict[float, Any]) -> None:
    low, high = resnext50_peaks[0.35], resnext50_peaks[0.8]
    assert low.fits and low.peak_tile_bytes <= _TILE, low.peak_tile_bytes
    # A higher proportion lets the planner pick the faster plans with larger temporaries
    # (one pass instead of serial ones): the peak rises, the cycles do not.
    assert high.peak_tile_bytes > low.peak_tile_bytes
    assert high.cycles <= low.cycles


@pytest.mark.xfail(strict=True, reason=(
    "not reproduced: every ResNeXt-50 convolution's fastest plan needs at most 306 KB of "
    "temporaries per tile (< 0.6 x 638,976 B), so 0.6 and 0.8 plan alike and peak at "
    "489,910 B (docs/tile_model.md, 'availableMemoryProportion')"))
def test_resnext50_does_not_fit_at_0_8(resnext50_peaks: dict[float, Any]) -> None:
    assert not resnext50_peaks[0.8].fits
