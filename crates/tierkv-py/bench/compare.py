"""tierkv from Python against plyvel (LevelDB), rocksdict (RocksDB) and lmdb: puts, gets and a
range scan of N x value-size records, one process, the same keys and values for every engine.

Not run by CI. Install the wheel and the peers into one virtual environment, then run it:

    python -m venv /tmp/bench && . /tmp/bench/bin/activate
    pip install maturin plyvel rocksdict lmdb
    maturin build --release -m crates/tierkv-py/Cargo.toml -o /tmp/wheels && pip install /tmp/wheels/tierkv-*.whl
    python crates/tierkv-py/bench/compare.py            # 100,000 x 1 KiB

Workloads (ops/s; each engine in a fresh directory):
  put   N puts of distinct 16-byte keys in random order, one call (one durable write) each
  get   N gets of those keys in another random order
  scan  one ordered range scan over all N entries (keys and values read)

Durability is the same for every engine: each acknowledged put survives a crash of the
process (kill -9), not necessarily power loss — tierkv writes its PM log (a mapped file,
no msync: its default), LevelDB and RocksDB their WAL without sync (their default), LMDB
commits each put in its own write transaction with sync=False (its default, sync=True,
would fsync every put). LevelDB and RocksDB keep their default block cache and plyvel's
default Snappy compression (the values are random bytes, so it gains nothing).
LMDB's gets share one read transaction (its idiom; a transaction per get would add ~1 µs).
A peer that is not installed is skipped and said so.
"""

import argparse
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time


def _version(dist):
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001 - a version string is only informative
        return "?"


def engines():
    """name -> (open(path) -> handle, put, get, scan(handle) -> count, close)."""
    out = {}
    try:
        import tierkv

        out["tierkv (native)"] = (
            lambda p: tierkv.open(p, preset="native"),
            lambda db, k, v: db.__setitem__(k, v),
            lambda db, keys: [db[k] for k in keys],
            lambda db: sum(1 for _ in db.items()),
            lambda db: db.close(),
            "tierkv %s (wheel, release build)" % tierkv.__version__,
        )
    except ImportError as e:
        print("tierkv: not installed (%s)" % e)
    try:
        import plyvel

        out["plyvel (LevelDB)"] = (
            lambda p: plyvel.DB(p, create_if_missing=True),
            lambda db, k, v: db.put(k, v),
            lambda db, keys: [db.get(k) for k in keys],
            lambda db: sum(1 for _ in db.iterator()),
            lambda db: db.close(),
            "plyvel %s (LevelDB %s.%s)" % (plyvel.__version__, *plyvel.__leveldb_version__.split(".")[:2])
            if hasattr(plyvel, "__leveldb_version__")
            else "plyvel %s" % plyvel.__version__,
        )
    except ImportError:
        print("plyvel: not installed, skipped")
    try:
        import rocksdict

        out["rocksdict (RocksDB)"] = (
            lambda p: rocksdict.Rdict(p, rocksdict.Options(raw_mode=True)),
            lambda db, k, v: db.__setitem__(k, v),
            lambda db, keys: [db[k] for k in keys],
            lambda db: sum(1 for _ in db.items()),
            lambda db: db.close(),
            "rocksdict %s" % _version("rocksdict"),
        )
    except ImportError:
        print("rocksdict: not installed, skipped")
    try:
        import lmdb

        def lmdb_put(env, k, v):
            with env.begin(write=True) as txn:
                txn.put(k, v)

        def lmdb_get(env, keys):
            with env.begin() as txn:
                return [txn.get(k) for k in keys]

        def lmdb_scan(env):
            with env.begin() as txn:
                return sum(1 for _ in txn.cursor())

        out["lmdb"] = (
            lambda p: lmdb.open(p, map_size=4 << 30, sync=False),
            lmdb_put,
            lmdb_get,
            lmdb_scan,
            lambda env: env.close(),
            "lmdb %s (LMDB %s)" % (lmdb.__version__, ".".join(map(str, lmdb.version()))),
        )
    except ImportError:
        print("lmdb: not installed, skipped")
    return out


def run_once(eng, root, keys, values, lookups):
    open_, put, get, scan, close, _ = eng
    path = tempfile.mkdtemp(dir=root)
    db = open_(path)
    t = time.perf_counter()
    for k, v in zip(keys, values):
        put(db, k, v)
    t_put = time.perf_counter() - t
    t = time.perf_counter()
    got = get(db, lookups)
    t_get = time.perf_counter() - t
    assert all(x is not None and len(x) == len(values[0]) for x in got), "a get missed"
    t = time.perf_counter()
    n = scan(db)
    t_scan = time.perf_counter() - t
    assert n == len(keys), "scan saw %d of %d" % (n, len(keys))
    close(db)
    shutil.rmtree(path, ignore_errors=True)
    return t_put, t_get, t_scan


def fmt(x):
    return "%.2fM" % (x / 1e6) if x >= 1e6 else "%.0fk" % (x / 1e3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num", type=int, default=100_000)
    ap.add_argument("--value-size", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3, help="runs per engine; the median is reported")
    ap.add_argument("--dir", default=None, help="where the stores are made (default: a temp dir)")
    args = ap.parse_args()

    rng = random.Random(24)
    keys = [b"%016d" % i for i in range(args.num)]
    rng.shuffle(keys)
    blob = rng.randbytes(args.value_size * 64) if hasattr(rng, "randbytes") else os.urandom(args.value_size * 64)
    values = [blob[(i % 63) * args.value_size // 2 :][: args.value_size] for i in range(args.num)]
    lookups = list(keys)
    rng.shuffle(lookups)

    found = engines()
    root = tempfile.mkdtemp(prefix="tierkv-compare-", dir=args.dir)
    print(
        "%d x %d B values, %d-byte keys, median of %d runs; Python %s, %s, %d CPUs, load %.2f"
        % (
            args.num,
            args.value_size,
            len(keys[0]),
            args.repeat,
            platform.python_version(),
            platform.machine(),
            os.cpu_count(),
            os.getloadavg()[0],
        )
    )
    print("engines: " + "; ".join(e[5] for e in found.values()))
    results = {}
    for name, eng in found.items():
        runs = [run_once(eng, root, keys, values, lookups) for _ in range(args.repeat)]
        results[name] = [args.num / statistics.median(r[i] for r in runs) for i in range(3)]
    shutil.rmtree(root, ignore_errors=True)

    base = results.get("tierkv (native)")
    print()
    print("| engine | put ops/s | get ops/s | scan entries/s |")
    print("|---|---|---|---|")
    for name, r in results.items():
        cells = [fmt(x) + ("" if base is None or name.startswith("tierkv") else " (%.2fx)" % (x / b)) for x, b in zip(r, base or r)]
        print("| %s | %s |" % (name, " | ".join(cells)))
    if base is not None:
        print("(in brackets: the engine's figure / tierkv's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
