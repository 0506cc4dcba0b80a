"""Device calls that can be stopped: a run deadline, a cancel from the client (Ctrl-C), the
session closing; and a Compile (its planning stops at a checkpoint, nothing is cached). A device loop stops at its next step and keeps the variables of the last
completed step; other loops stop at their next iteration and keep nothing; the IPU takes the
next call at once.

Programs: ``server_util.steps_module`` (hand-built IR: a loop of ``w += 1`` steps, each with
an inner loop that never ends from step ``stall`` on) and, for Keras, ``keras_util.
stall_model`` (a layer whose ``while`` never ends from a given step on). References: numpy
(``w`` counts completed steps exactly) and the same model trained on the CPU.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import server_util as su

from tf_ipu import errors
from tf_ipu.client import DeviceClient, VariableRef

NEVER = np.int32(2**31 - 1)
DIM = 64


@pytest.fixture(scope="module")
def client(device_server):
    c = DeviceClient(device_server)
    c.open_session()
    c.attach(1)
    yield c
    c.close()


def _programs(client: DeviceClient) -> dict[bool, str]:
    return {loop: client.compile(su.steps_module(DIM, device_loop=loop, name=f"steps{loop}")).executable_id
            for loop in (True, False)}


def _w(client: DeviceClient) -> np.ndarray:
    return client.read_variables(["w"])["w"]


def test_run_deadline_stops_a_never_ending_step_and_keeps_the_completed_ones(client):
    exe = _programs(client)[True]
    client.write_variables({"w": np.zeros(DIM, np.float32)})
    start = time.monotonic()
    with pytest.raises(errors.DeadlineExceededError, match=r"after 3 completed steps .* step 3"):
        client.execute(exe, [VariableRef("w"), NEVER, np.int32(3)], run_deadline=1.0)
    assert time.monotonic() - start < 5.0
    np.testing.assert_array_equal(_w(client), np.full(DIM, 3, np.float32))  # exact: 3 steps
    # The IPU takes the next call at once, from the kept state.
    steps, w = client.execute(exe, [VariableRef("w"), np.int32(4), NEVER],
                              return_updated_variables=True)
    assert int(steps) == 4
    np.testing.assert_array_equal(w, np.full(DIM, 7, np.float32))


def test_cancel_stops_a_device_loop_at_a_step_boundary(client):
    exe = _programs(client)[True]
    client.write_variables({"w": np.zeros(DIM, np.float32)})
    timer = threading.Timer(0.5, client.cancel_running)
    timer.start()
    start = time.monotonic()
    with pytest.raises(errors.CancelledError, match=r"the client cancelled the call\) after \d+ "
                       r"completed steps"):
        client.execute(exe, [VariableRef("w"), NEVER, NEVER])
    assert time.monotonic() - start < 5.0
    w = _w(client)  # queued behind the stopping run on the server
    k = w[0]
    assert k >= 1 and k == int(k), k  # a whole number of steps, none half done
    np.testing.assert_array_equal(w, np.full(DIM, k, np.float32))
    steps, w = client.execute(exe, [VariableRef("w"), np.int32(2), NEVER],
                              return_updated_variables=True)
    np.testing.assert_array_equal(w, np.full(DIM, k + 2, np.float32))
    assert client.counters()["runs_stopped.cancelled"] >= 1


def test_a_loop_that_is_not_a_device_loop_keeps_nothing(client):
    exe = _programs(client)[False]
    client.write_variables({"w": np.full(DIM, 5, np.float32)})
    start = time.monotonic()
    with pytest.raises(errors.DeadlineExceededError, match="nothing of this call was kept"):
        client.execute(exe, [VariableRef("w"), NEVER, np.int32(2)], run_deadline=0.5)
    assert time.monotonic() - start < 5.0
    np.testing.assert_array_equal(_w(client), np.full(DIM, 5, np.float32))


def test_closing_the_session_stops_its_run(device_server):
    c = DeviceClient(device_server)
    c.open_session()
    c.attach(1)
    exe = c.compile(su.steps_module(DIM, name="steps_close")).executable_id
    c.write_variables({"w": np.zeros(DIM, np.float32)})
    failure: list[BaseException] = []

    def run() -> None:
        try:
            c.execute(exe, [VariableRef("w"), NEVER, NEVER])
        except BaseException as e:
            failure.append(e)

    runner = threading.Thread(target=run)
    runner.start()
    time.sleep(0.5)
    start = time.monotonic()
    c.close()  # CloseSession: the server stops the run, then closes the session
    runner.join(10)
    assert not runner.is_alive() and time.monotonic() - start < 5.0
    assert failure and isinstance(failure[0], errors.DeviceError)
    # Its IPU is free again: a new session can take all of the server's free IPUs.
    probe = DeviceClient(device_server)
    probe.open_session()
    assert probe.attach(1).ipu_ids
    probe.close()


def test_keras_run_deadline_keeps_the_last_completed_step(ipu_system):
    import keras
    import tensorflow as tf
    from keras_util import stall_model

    import tf_ipu

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    with tf_ipu.IPUStrategy().scope():
        model = stall_model(stall_at=3)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=8)
    ipu_system.run_deadline = 1.0
    try:
        start = time.monotonic()
        with pytest.raises(tf.errors.DeadlineExceededError, match="after 3 completed steps"):
            model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        assert time.monotonic() - start < 10.0
    finally:
        ipu_system.run_deadline = 0.0
    reference = stall_model(stall_at=10**9)
    reference.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    for i in range(3):
        reference.train_on_batch(x[8 * i:8 * i + 8], y[8 * i:8 * i + 8])
    got = model.get_weights()  # fetched from the device: the weights of step 3
    for a, b in zip(got, reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(model.get_layer("stall").calls.numpy()) == 3
    # The IPU is usable at once (inference does not stall).
    np.testing.assert_allclose(model.predict(x[:8], verbose=0),
                               reference.predict(x[:8], verbose=0), rtol=1e-5, atol=1e-6)


_SIGINT_SCRIPT = r"""
import os, sys, threading, time
import numpy as np, keras
import tf_ipu
from keras_util import stall_model

cfg = tf_ipu.IPUConfig()
cfg.server_address = os.environ["SERVER"]
cfg.configure_ipu_system()
x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
y = x[:, :1] * 2.0

class Started(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        def watch():  # says when the device call is running (its step 2 never ends)
            while not tf_ipu.get_runtime().call_in_flight():
                time.sleep(0.01)
            print("STARTED", flush=True)
        threading.Thread(target=watch, daemon=True).start()

with tf_ipu.IPUStrategy().scope():
    model = stall_model(stall_at=2)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=8)
try:
    model.fit(x, y, batch_size=8, epochs=10**6, verbose=0, shuffle=False, callbacks=[Started()])
except KeyboardInterrupt:
    print("INTERRUPTED", time.monotonic(), flush=True)
calls = int(model.get_layer("stall").calls.numpy())
weights = model.get_weights()
print("CALLS", calls, flush=True)
print("PREDICT", model.predict(x[:8], verbose=0).shape, flush=True)
"""


def test_sigint_during_a_never_ending_fit_raises_keyboard_interrupt(device_server, tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(_SIGINT_SCRIPT)
    tests = str(Path(__file__).parent)
    env = su.child_env(SERVER=device_server, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = tests + os.pathsep + env.get("PYTHONPATH", "")
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env,
                             preexec_fn=su.sigint_default)
    lines: list[str] = []
    sent = None
    watchdog = threading.Timer(120, child.kill)  # a child that never stops fails, not hangs
    watchdog.start()
    try:
        assert child.stdout is not None
        for line in child.stdout:
            lines.append(line.rstrip())
            if line.startswith("STARTED") and sent is None:
                time.sleep(0.5)  # inside the device call: its step 2 never ends
                sent = time.monotonic()
                child.send_signal(signal.SIGINT)
            if line.startswith("INTERRUPTED"):
                assert sent is not None and float(line.split()[1]) - sent < 5.0, lines
        child.wait(60)
    finally:
        watchdog.cancel()
        if child.poll() is None:
            child.kill()
    out = "\n".join(lines)
    assert child.returncode == 0, f"exit {child.returncode} (-9: stopped by the watchdog)\n{out}"
    assert "INTERRUPTED" in out, out
    assert "CALLS 2" in out, out  # the weights of the 2 completed steps were kept
    assert "PREDICT (8, 1)" in out, out


# -- the infeed: the device pulls batches while it runs ---------------------------------------


def test_the_device_pulls_infeed_batches_while_the_host_pushes_them(client):
    exe = client.compile(su.infeed_module("fit", name="infeed_fit")).executable_id
    client.write_variables({"w": np.zeros(8, np.float32)})
    rng = np.random.default_rng(5)
    batches = [rng.standard_normal((4, 8)).astype(np.float32) for _ in range(6)]
    pushed: list[float] = []

    def feed() -> None:  # a slow input pipeline: one batch each 0.2 s
        for b in batches:
            time.sleep(0.2)
            client.push_infeed("fit", [[b]])
            pushed.append(time.monotonic())
        client.push_infeed("fit", [], end=True)

    feeder = threading.Thread(target=feed)
    start = time.monotonic()
    feeder.start()
    steps, w = client.execute(exe, [VariableRef("w"), np.int32(100)], return_updated_variables=True)
    end = time.monotonic()
    feeder.join()
    assert int(steps) == 6  # the feed ended after 6 batches: so did the loop
    np.testing.assert_allclose(w, sum(b.sum(0) for b in batches), rtol=1e-6)
    # The batches arrived while the device call was running (it pulled each as it came).
    assert all(start < t < end for t in pushed)


def test_a_run_waiting_for_its_infeed_stops_at_its_deadline(client):
    exe = client.compile(su.infeed_module("slow", name="infeed_slow")).executable_id
    client.write_variables({"w": np.zeros(8, np.float32)})
    client.push_infeed("slow", [[np.ones((4, 8), np.float32)]] * 2)  # 2 batches, then nothing
    start = time.monotonic()
    with pytest.raises(errors.DeadlineExceededError, match="after 1 completed steps"):
        client.execute(exe, [VariableRef("w"), np.int32(100)], run_deadline=0.5)
    assert time.monotonic() - start < 5.0
    # Step 1 took the 2nd batch and then waited for a 3rd: it was abandoned, step 0 kept.
    np.testing.assert_array_equal(_w(client), np.full(8, 4, np.float32))


def test_cancel_stops_a_compile_and_the_session_compiles_the_next_at_once(client):
    from interrupt_util import chain_module

    module = chain_module(12000, name="chain_cancelled")  # ~14 s of planning
    timer = threading.Timer(1.0, client.cancel_running)
    timer.start()
    start = time.monotonic()
    with pytest.raises(errors.CancelledError, match="stopped .cancelled. while .*nothing was "
                       "compiled or cached"):
        client.compile(module)
    assert time.monotonic() - start < 5.0
    start = time.monotonic()
    exe = client.compile(su.sgd_module(name="after_cancelled_compile")).executable_id
    assert exe and time.monotonic() - start < 5.0
    assert client.counters()["compiles_stopped.cancelled"] >= 1
