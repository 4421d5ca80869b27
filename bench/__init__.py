"""tfmx's benchmark: stock vs tfmx vs XLA training step time, interleaved, per oneDNN state.

A package beside the library (``tfmx``, ``fusion``, ``policies``) and its recipes, kept in the
repository and not in the wheel: it imports them, they never import it. ``tfmx bench ...`` runs
``python -m bench ...`` (:mod:`bench.cli`) from a clone.

- :mod:`bench.workloads`: the models timed (:data:`bench.workloads.WORKLOADS`, the ``zoo``
  group), their random data, and each mode's build (stock, tfmx, XLA).
- :mod:`bench.zoo`: keras.applications and keras_hub models nobody here wrote.
- :mod:`recipes._timing` (the recipes' and the benchmark's): step functions timed in
  interleaved rounds; per-round ratios.
- :mod:`bench.runner`: building, tracing and timing every mode of a workload, here or in one
  process per oneDNN state (:mod:`bench.onednn`), optionally under replicas
  (:mod:`bench.replicas`).
- :mod:`bench.environment`: the machine and versions (:func:`recipes._machine.environment`,
  recorded with every result) as the tables print them.
- :mod:`bench.compare`: the best alternative (the fastest of stock and XLA) and tfmx against
  it; :mod:`bench.tables`: the markdown output.
- :mod:`bench.fit_price`: what tfmx costs on whole short fits (``python -m bench.fit_price``).
- :mod:`bench.records`: ``tfmx bench --record`` keeps each result as JSON under
  ``bench/results/``, one file per workload and oneDNN state; :mod:`bench.publish`
  (``python -m bench.tables --markdown``) writes BENCHMARKS.md and the README's table from them.

Example:
    >>> from bench.runner import run_benchmark
    >>> from bench.tables import format_markdown
    >>> print(format_markdown(run_benchmark("mlp", rounds=3, steps=5)))  # doctest: +SKIP
"""
