"""bench.loop: the small models build and train under Keras 3, its rows, records and section."""

import numpy as np
import pytest

from bench import loop


@pytest.mark.parametrize("name", sorted(loop.MODELS))
def test_each_small_model_trains_a_step(name):
    import keras

    model, x_shape, y_shape, loss = loop.MODELS[name](keras)
    model.compile("adam", loss)
    x = np.zeros((4, *x_shape), "float32")
    y = np.zeros((4, *y_shape), "float32")
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert len(history.history["loss"]) == 1


def test_rows_ratios_and_the_loops_choice():
    row = loop.summarize("mlp", {"stock": [4.0, 6.0, 5.0], "tfmx": [2.0, 3.0, 2.5],
                                 "xla": [], "keras2": [4.0, 5.0, 6.0]},
                         {"steps_per_call": 32, "why": "measured"})
    assert row["modes"]["stock"] == {"median_ms": 5.0, "p25_ms": 4.5, "p75_ms": 5.5,
                                     "rounds": 3}
    assert "xla" not in row["modes"]
    assert row["ratios"] == {"tfmx/keras2": 0.5, "tfmx/stock": 0.5}
    assert row["steps_per_call"] == 32


def test_records_round_trip_into_the_section(tmp_path):
    from bench.records import processor_key
    from recipes._machine import environment

    row = loop.summarize("mlp", {"stock": [4.0], "tfmx": [2.0]}, None)
    command = "python -m bench.loop --model mlp --record"
    env = environment()
    paths = loop.write_records([row], command, env, tmp_path / "loop")
    key = processor_key(env)
    assert [p.name for p in paths] == [f"mlp-{key}.json" if key else "mlp.json"]
    # another processor's record sits beside this one's, in a table of its own
    other = {**env, "cpu": "Elsewhere", "cpu_vendor": "GenuineIntel", "cpu_family": "6",
             "cpu_model": "207"}
    (path,) = loop.write_records([row], command, other, tmp_path / "loop")
    assert path.name == "mlp-intel-f6-m207.json"
    assert "Elsewhere" in loop.format_loop_section(loop.load_records(tmp_path / "loop"))
    path.unlink()
    records = loop.load_records(tmp_path / "loop")
    assert records[0]["modes"] == row["modes"] and records[0]["command"] == command
    section = loop.format_loop_section(records)
    assert section.startswith("## Small models")
    assert "| mlp | 4.0 (4.0-4.0) | 2.0 (2.0-2.0) | - | - | - | 0.5 | - |" in section
    assert f"Command: `{command}`" in section
    assert loop.format_loop_section([]) == ""
    from bench import publish

    assert publish.extra_sections(tmp_path)[4] == section  # BENCHMARKS.md's section

