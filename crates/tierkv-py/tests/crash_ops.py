"""The deterministic operation stream of test_crash.py's writer, shared by the checker."""

import random


def value(key, size):
    return (key * (size // len(key) + 1))[:size]


def ops(cycle, n=200_000):
    """Puts of fresh keys, deletes of keys put earlier in the cycle, and 3-key batches."""
    rng = random.Random(cycle)
    for i in range(n):
        key = b"c%03d-%07d" % (cycle, i)
        r = i % 10
        if r == 9 and i >= 10:
            yield ("delete", b"c%03d-%07d" % (cycle, i - 7))
        elif r == 5:
            yield ("batch", [(key + b"-%d" % j, value(key, 50)) for j in range(3)])
        else:
            yield ("put", key, value(key, rng.choice([10, 100, 1000, 5000])))
