"""Threads: store calls release the GIL, a Db is shared safely, close() races cleanly."""

import sys
import threading
import time

import pytest

import tierkv
from conftest import REPORT, open_small


class Counter(threading.Thread):
    """A pure-Python thread counting as fast as it can: it advances only while it holds the GIL."""

    def __init__(self):
        super().__init__(daemon=True)
        self.n = 0
        self.stop = False
        self.started = threading.Event()

    def run(self):
        self.started.set()
        while not self.stop:
            self.n += 1


def progress_during(counter, call):
    before = counter.n
    call()
    return counter.n - before


def test_a_long_store_call_lets_other_python_threads_run(path):
    """During one long native call (a put of 512 KiB with 20 µs of emulated PM latency per
    64-byte line: >= 8192 lines, so >= 160 ms spinning inside tierkv) a pure-Python thread
    makes progress. Control: the same measurement around a GIL-holding C call (sorted) sees
    none. With a switch interval of 0.5 s the interpreter does not preempt the main thread
    during either call, so the counter can only advance while a call has released the GIL:
    no timing threshold is asserted."""
    big = list(range(300_000, 0, -1))
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    counter = Counter()
    try:
        with open_small(path, pm_write_latency_ns=20_000) as db:
            counter.start()
            counter.started.wait()
            control = progress_during(counter, lambda: sorted(big))
            lines = db.stats()["pm"]["lines_persisted"]
            native = progress_during(counter, lambda: db.put(b"big", b"x" * (512 << 10)))
            lines = db.stats()["pm"]["lines_persisted"] - lines
            assert db[b"big"] == b"x" * (512 << 10)
    finally:
        counter.stop = True
        sys.setswitchinterval(old)
        counter.join()
    assert lines >= 8192, "the put persisted too little to take long: the test measures nothing"
    assert control == 0, "a GIL-holding call let the counter run: the measurement is broken"
    assert native > 0, "the Python thread made no progress during a store call: the GIL was held"
    REPORT.append("GIL: a pure-Python thread counted to %d during one slow put (0 during sorted())" % native)


def test_a_gil_holding_call_fails_the_check():
    """The check of the test above fails on a call that holds the GIL (a C call that never
    releases it) and passes on one that releases it (time.sleep)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    counter = Counter()
    try:
        counter.start()
        counter.started.wait()
        held = progress_during(counter, lambda: sorted(range(400_000, 0, -1)))
        # ... where a call that releases the GIL passes it:
        released = progress_during(counter, lambda: time.sleep(0.05))
    finally:
        counter.stop = True
        sys.setswitchinterval(old)
        counter.join()
    assert held == 0 and released > 0


def _reads(db, keys, rounds):
    for _ in range(rounds):
        for k in keys:
            db[k]


def _timed_parallel(db, keys, threads, rounds):
    ts = [threading.Thread(target=_reads, args=(db, keys, rounds)) for _ in range(threads)]
    t = time.perf_counter()
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    return time.perf_counter() - t


@pytest.mark.parametrize("read_latency_ns", [0, 20_000])
def test_parallel_read_speedup_is_reported(tmp_path, read_latency_ns):
    """Measured and reported only (a shared 2-core machine gives no stable figure): the same
    number of gets by 1 thread and by 2 threads. With emulated PM read latency the store's
    share of a get grows, and so does the gain from releasing the GIL."""
    with open_small(tmp_path / "s", pm_read_latency_ns=read_latency_ns) as db:
        keys = [b"key%06d" % i for i in range(2_000)]
        with db.write_batch() as b:
            for k in keys:
                b.put(k, b"v" * 100)
        rounds = 4 if read_latency_ns else 20
        one = _timed_parallel(db, keys, 1, rounds)
        two = _timed_parallel(db, keys, 2, rounds // 2)
        n = len(keys) * rounds
    REPORT.append(
        "parallel gets (PM read latency %d ns): 1 thread %.0f/s, 2 threads %.0f/s, speed-up %.2fx"
        % (read_latency_ns, n / one, n / two, one / two)
    )


def test_threads_share_a_db(db):
    errors = []

    def writer(t):
        try:
            for i in range(300):
                k = b"t%d-%04d" % (t, i)
                if i % 3 == 0:
                    with db.write_batch() as b:
                        b.put(k, b"%d" % i)
                        b.put(k + b"-pair", b"%d" % i)
                else:
                    db[k] = b"%d" % i
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    def reader():
        try:
            for _ in range(30):
                seen = dict(db.items(prefix=b"t"))
                for k, v in seen.items():
                    if k.endswith(b"-pair"):
                        # A batch is seen whole by an iterator (a consistent snapshot).
                        assert seen[k[: -len(b"-pair")]] == v
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    ts += [threading.Thread(target=reader) for _ in range(2)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    assert errors == []
    for t in range(4):
        assert len(list(db.keys(prefix=b"t%d-" % t))) == 300 + 100


def test_close_races_with_other_threads(path):
    """Threads hammer a Db while another closes it: each gets ClosedError, never a crash
    or another error, and the store reopens with what they wrote."""
    db = open_small(path)
    for i in range(500):
        db[b"k%04d" % i] = b"v"
    outcomes = []
    go = threading.Event()

    def worker(kind):
        go.wait()
        try:
            while True:
                if kind == 0:
                    db[b"k0001"]
                elif kind == 1:
                    db[b"w"] = b"x"
                elif kind == 2:
                    for _ in db.items():
                        pass
                else:
                    with db.snapshot() as s:
                        list(s.keys(stop=b"k0100"))
        except tierkv.ClosedError:
            outcomes.append("closed")
        except Exception as e:  # pragma: no cover - reported below
            outcomes.append(repr(e))

    ts = [threading.Thread(target=worker, args=(i % 4,)) for i in range(8)]
    for th in ts:
        th.start()
    go.set()
    time.sleep(0.2)
    db.close()
    for th in ts:
        th.join()
    assert outcomes == ["closed"] * 8
    with open_small(path) as db2:
        assert db2[b"w"] == b"x" and db2[b"k0499"] == b"v"
