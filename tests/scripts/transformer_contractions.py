"""The transformer workload's contractions alone, timed interleaved with its two steps.

Every MatMul and batched MatMul of ``tfmx bench``'s ``transformer`` step at its shapes (the
input projection, 2 blocks x Q/K/V/O projections and the two FFN MatMuls, the attention's two
batched MatMuls; forward and both gradients of each) in one ``tf.function`` with nothing else,
timed interleaved with the stock and the tfmx training step (12 rounds x 5 steps, medians).
A measurement script (BENCHMARKS.md), not a test: ``python
tests/scripts/transformer_contractions.py`` prints the three medians in ms.
"""

import statistics
import time

import numpy as np
import tensorflow as tf

import tfmx
from bench.workloads import WORKLOADS

B, T, D, F, H, N = 32, 64, 128, 512, 32, 4
rows = B * T
shapes = [(rows, 32, D)] + [(rows, D, D)] * 8 + [(rows, D, F), (rows, F, D)] * 2
mats = [(tf.random.normal([m, k]), tf.random.normal([k, n]), tf.random.normal([m, n]))
        for m, k, n in shapes]
q = tf.random.normal([B * N, T, H])
s = tf.random.normal([B * N, T, T])


@tf.function
def contractions():
    out = []
    for x, w, g in mats:
        out += [x @ w, tf.matmul(g, w, transpose_b=True), tf.matmul(x, g, transpose_a=True)]
    for _ in range(2):  # per block: scores and weighted sum, forward + both gradients each
        out += [tf.matmul(q, q, transpose_b=True), tf.matmul(s, q), tf.matmul(s, q),
                tf.matmul(s, q, transpose_a=True), tf.matmul(s, q),
                tf.matmul(s, q, transpose_a=True)]
    return tf.add_n([tf.reduce_sum(o) for o in out])


w = WORKLOADS["transformer"]
x = np.random.default_rng(0).standard_normal((B * 4, T, 32)).astype("float32")
y = np.random.default_rng(1).integers(0, 10, B * 4)
models = {}
for mode in ("stock", "tfmx"):
    tfmx.enable(guard=False) if mode == "tfmx" else tfmx.disable()
    m = w.build()
    m.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    m.fit(x, y, batch_size=B, epochs=2, verbose=0)
    models[mode] = m
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(B).repeat()
its = {k: iter(ds) for k in models}
runs = {"contractions": lambda: contractions().numpy(),
        **{k: (lambda k=k: models[k].train_function(its[k])) for k in models}}
for run in runs.values():
    run()
times = {k: [] for k in runs}
for _ in range(12):
    for k, run in runs.items():
        t0 = time.perf_counter()
        for _ in range(5):
            run()
        times[k].append((time.perf_counter() - t0) / 5 * 1e3)
print({k: round(statistics.median(v), 2) for k, v in times.items()})
