"""bench_fit_cases reuses bench_mlperf's estimate of the same model with the same options, made
earlier in the process (``make bench`` runs both), and estimates anything else itself.

Small Dense models stand in for bench_mlperf's BERT (registered as ``_bert`` registers its
models); about 10 s.
"""

from __future__ import annotations

import keras
import pytest

import tf_ipu
from bench import bench_fit_cases, bench_mlperf


def _model() -> keras.Model:
    with tf_ipu.IPUStrategy().scope():
        x = keras.Input((8,))
        model = keras.Model(x, keras.layers.Dense(4)(x))
        model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.fixture
def shared() -> dict:
    saved = dict(bench_mlperf.SHARED)
    bench_mlperf.SHARED.clear()
    yield bench_mlperf.SHARED
    bench_mlperf.SHARED.clear()
    bench_mlperf.SHARED.update(saved)


def test_key_covers_builder_arguments_batch_and_options() -> None:
    a, b, other = _model(), _model(), _model()
    bench_mlperf._BUILT[a] = bench_mlperf._BUILT[b] = "bert(args)"
    options = {"ipu_version": "ipu2", "replicas": 4, "partials_type": "half"}
    key = bench_mlperf.shared_key(a, 2, True, options)
    assert key is not None
    assert bench_mlperf.shared_key(b, 2, True, dict(options)) == key   # same arguments
    assert bench_mlperf.shared_key(b, 2, True, {**options, "steps": 1}) == key  # steps only wraps
    assert bench_mlperf.shared_key(b, 3, True, options) != key          # batch
    assert bench_mlperf.shared_key(b, 2, False, options) != key         # inference
    assert bench_mlperf.shared_key(b, 2, True, {**options, "replicas": 2}) != key
    assert bench_mlperf.shared_key(b, 2, True, {**options, "partials_type": None}) != key
    bench_mlperf._BUILT[b] = "bert(other args)"
    assert bench_mlperf.shared_key(b, 2, True, options) != key          # builder arguments
    assert bench_mlperf.shared_key(other, 2, True, options) is None     # not a _bert model


def test_fit_cases_reuses_the_mlperf_estimate_and_its_stash(shared: dict) -> None:
    model = _model()
    bench_mlperf._BUILT[model] = "bert(args)"
    options = {"ipu_version": "ipu2"}
    est, stash = object(), {"checkpoints": [1]}
    shared[bench_mlperf.shared_key(model, 2, True, options)] = (est, stash)
    plan = bench_fit_cases.Plan(model, 2, True, options, capture=bench_mlperf._checkpoint_stash)
    assert bench_fit_cases._estimate(plan, options) == (est, stash, True)
    plain = bench_fit_cases.Plan(model, 2, True, options)
    assert bench_fit_cases._estimate(plain, options) == (est, None, True)


def test_fit_cases_estimates_what_was_not_shared(shared: dict) -> None:
    model = _model()
    bench_mlperf._BUILT[model] = "bert(args)"
    shared[bench_mlperf.shared_key(model, 2, True, {"ipu_version": "ipu2"})] = (object(), {})
    options = {"ipu_version": "bow"}   # another chip: estimated here
    est, found, reused = bench_fit_cases._estimate(bench_fit_cases.Plan(model, 2, True, options),
                                                   options)
    assert not reused and found is None
    fresh = tf_ipu.estimate(model, 2, training=True, ipu_version="bow")
    assert est.peak_tile_bytes == fresh.peak_tile_bytes and est.cycles == fresh.cycles


def pipelined_estimate() -> tuple:
    """A two-stage pipelined training estimate, as bench_mlperf's BERT runs make theirs: the
    step's Estimate and the checkpoint stash recorded while planning it (what ``SHARED`` keeps,
    and what a worker of ``bench.parallel`` returns to the parent)."""
    with tf_ipu.IPUStrategy().scope():
        x = keras.Input((8,))
        h = keras.layers.Dense(16, activation="relu")(x)
        model = keras.Model(x, keras.layers.Dense(4)(keras.layers.Dense(16)(h)))
        model.compile(optimizer="sgd", loss="mse")
        model.set_pipeline_stage_assignment([0, 0, 1])
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=4)
    with bench_mlperf._checkpoint_stash() as stashed:
        est = tf_ipu.estimate(model, 2, training=True, ipu_version="ipu2", steps=1)
    return getattr(est, "step", est), stashed


def test_a_shared_estimate_made_in_a_worker_is_the_one_made_here(shared: dict) -> None:
    import numpy as np

    from bench import parallel

    here, stash_here = pipelined_estimate()
    (there, stash_there), _ = parallel.run([(__name__, "pipelined_estimate", ())] * 2, 2)
    assert there.stages and there.peak_tile_bytes == here.peak_tile_bytes
    assert there.cycles == here.cycles and there.peak_tile == here.peak_tile
    assert stash_there.keys() == stash_here.keys() and "checkpoints" in stash_there
    for k in stash_here:
        assert all(np.array_equal(a, b) for a, b in zip(stash_here[k], stash_there[k], strict=True))
    # Installed in the parent (as estimate_rows does), fit_cases takes it instead of estimating.
    model = _model()
    bench_mlperf._BUILT[model] = "bert(args)"
    options = {"ipu_version": "ipu2"}
    shared[bench_mlperf.shared_key(model, 2, True, options)] = (there, stash_there)
    plan = bench_fit_cases.Plan(model, 2, True, options, capture=bench_mlperf._checkpoint_stash)
    assert bench_fit_cases._estimate(plan, options) == (there, stash_there, True)
