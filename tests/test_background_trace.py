"""Tracing on a thread of its own beside a fit: what the worker inherits, what waits for what."""

from __future__ import annotations

import threading
import time

import keras
import pytest

from tfmx import background_trace, fit_plan
from tfmx.background_trace import BackgroundTrace


def test_the_worker_sees_the_fits_plan_and_keras_global_state():
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        with fit_plan.fitting(2, 10) as plan:
            seen = BackgroundTrace(lambda: (fit_plan.active_plan(),
                                            keras.config.dtype_policy().name,
                                            threading.current_thread())).start().take()
    finally:
        keras.config.set_dtype_policy(previous)
    assert seen[0] is plan and seen[1] == "mixed_float16"
    assert seen[2] is not threading.current_thread()


def test_the_works_exception_is_raised_where_it_is_taken():
    trace = BackgroundTrace(lambda: 1 / 0).start()
    trace.wait()
    assert trace.ready() and not background_trace.running()
    with pytest.raises(ZeroDivisionError):
        trace.take()


def test_the_fits_thread_waits_for_its_trace_before_tracing_anything_else():
    release = threading.Event()
    trace = BackgroundTrace(release.wait).start()
    assert background_trace.running() and not trace.ready()
    threading.Timer(0.2, release.set).start()
    with background_trace.waiting():  # this thread started it: waits until it is done
        assert trace.ready()
    seen = []
    other = BackgroundTrace(lambda: time.sleep(0.2)).start()

    def trace_elsewhere():
        with background_trace.waiting():
            seen.append(other.ready())

    worker = threading.Thread(target=trace_elsewhere)
    worker.start()
    worker.join()
    assert seen == [False]  # another thread goes on at once
    other.wait()


def test_a_step_beside_a_trace_never_runs_beside_the_tuners_measuring():
    events = []
    measuring = threading.Event()

    def measure():
        with background_trace.measuring():
            measuring.set()
            events.append("measure starts")
            time.sleep(0.2)
            events.append("measure ends")

    worker = threading.Thread(target=measure)
    worker.start()
    measuring.wait()
    with background_trace.stepping():
        events.append("step")
    worker.join()
    assert events == ["measure starts", "measure ends", "step"]
