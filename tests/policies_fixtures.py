"""Fixtures the policies tests share: keras's global policy and the compile hook restored."""

import pytest


@pytest.fixture(autouse=True)
def restore_global_policy():
    """Whatever a test sets, keras's global policy and compile come back afterwards."""
    import keras

    from policies import global_policy, hook

    saved = keras.config.dtype_policy()
    saved_hw = global_policy._STATE.hardware
    yield
    global_policy.reset()
    global_policy._STATE.hardware = saved_hw
    hook.uninstall()
    keras.config.set_dtype_policy(saved)
