"""The API surface of `tierkv` and its errors."""

import array
import glob
import os
import pathlib

import pytest

import tierkv
from conftest import open_small


def test_module_surface():
    assert "native" in tierkv.PRESETS
    assert isinstance(tierkv.__version__, str)
    for name in ["Error", "CorruptionError", "InvalidArgument", "PmFullError", "PoisonedError", "ClosedError"]:
        assert issubclass(getattr(tierkv, name), tierkv.Error)
        assert getattr(tierkv, name).__module__ == "tierkv"
    assert issubclass(tierkv.Error, Exception)
    assert issubclass(tierkv.InvalidArgument, ValueError)
    assert not issubclass(tierkv.ClosedError, ValueError)
    assert tierkv.open.__doc__ and tierkv.Db.__doc__ and tierkv.Db.items.__doc__


def test_stubs_and_marker_are_installed():
    pkg = pathlib.Path(tierkv.__file__).parent
    assert (pkg / "py.typed").exists()
    stubs = (pkg / "__init__.pyi").read_text()
    for name in ["def open(", "class Db:", "class WriteBatch:", "class Snapshot:", "class InvalidArgument(Error, ValueError)"]:
        assert name in stubs


def test_mapping_basics(db):
    db[b"k"] = b"v"
    assert db[b"k"] == b"v"
    assert type(db[b"k"]) is bytes
    assert b"k" in db and b"x" not in db
    assert db.get(b"x") is None
    assert db.get(b"x", b"dflt") == b"dflt"
    assert db.get(b"k", b"dflt") == b"v"
    with pytest.raises(KeyError) as e:
        db[b"missing"]
    assert e.value.args == (b"missing",)
    del db[b"k"]
    assert b"k" not in db
    del db[b"k"]  # absent: not an error (documented)
    db.put(b"a", b"1")
    db.delete(b"a")
    assert db.get(b"a") is None


def test_binary_and_empty_keys_and_values(db):
    keys = [b"", b"\x00", b"\x00\x00", b"\xff", b"\xff\xff", b"a\x00b"]
    for i, k in enumerate(keys):
        db[k] = bytes([i]) * i
    for i, k in enumerate(keys):
        assert db[k] == bytes([i]) * i
    assert list(db.keys()) == sorted(keys)
    db[b"empty"] = b""
    assert db[b"empty"] == b"" and b"empty" in db


def test_buffer_inputs_accepted(db):
    db[bytearray(b"ba")] = bytearray(b"1")
    db[memoryview(b"mv")] = memoryview(b"2")
    db[array.array("B", b"ar")] = array.array("B", b"3")
    db[memoryview(b"xaxbx")[1::2]] = b"4"  # non-contiguous view: its bytes in order
    assert db[b"ba"] == b"1" and db[b"mv"] == b"2" and db[b"ar"] == b"3" and db[b"ab"] == b"4"
    assert db[bytearray(b"ba")] == b"1"
    assert memoryview(b"mv") in db


@pytest.mark.parametrize("bad", ["text", 1, 1.5, None, [1, 2], object()])
def test_non_bytes_refused_with_type_error(db, bad):
    with pytest.raises(TypeError):
        db[bad] = b"v"
    with pytest.raises(TypeError):
        db[b"k"] = bad
    with pytest.raises(TypeError):
        db.get(bad)
    with pytest.raises(TypeError):
        db.write_batch().put(bad, b"v")
    if bad is not None:  # None means "unbounded" for ranges
        with pytest.raises(TypeError):
            db.items(start=bad)
    assert list(db.items()) == []


def test_str_error_says_to_encode(db):
    with pytest.raises(TypeError, match="not str"):
        db["k"] = b"v"


def test_limits_are_invalid_argument_and_write_nothing(path):
    with open_small(path, max_value_size=1000) as db:
        with pytest.raises(tierkv.InvalidArgument):
            db[b"x" * 65536] = b"v"
        with pytest.raises(ValueError):
            db[b"k"] = b"v" * 1001
        db[b"k"] = b"v" * 1000
        assert db[b"k"] == b"v" * 1000
        with pytest.raises(tierkv.InvalidArgument):
            with db.write_batch() as b:
                b.put(b"ok", b"1")
                b.put(b"big", b"v" * 1001)
        assert b"ok" not in db  # the whole batch was refused


def test_write_batch_commits_on_exit(db):
    db[b"b"] = b"old"
    with db.write_batch() as b:
        b.put(b"a", b"1")
        b.delete(b"b")
        b[b"c"] = b"3"
        assert len(b) == 3
        assert b"a" not in db  # not applied before the block ends
    assert db[b"a"] == b"1" and b"b" not in db and db[b"c"] == b"3"


def test_write_batch_discarded_when_block_raises(db):
    db[b"keep"] = b"1"
    with pytest.raises(RuntimeError):
        with db.write_batch() as b:
            b.put(b"a", b"1")
            b.delete(b"keep")
            raise RuntimeError("boom")
    assert b"a" not in db and db[b"keep"] == b"1"


def test_write_batch_commit_and_reuse(db):
    b = db.write_batch()
    b.put(b"x", b"1")
    b.commit()
    assert db[b"x"] == b"1" and len(b) == 0
    b.put(b"y", b"2")
    b.clear()
    b.commit()
    assert b"y" not in db
    b.put(b"k", b"1")
    b.put(b"k", b"2")  # later operations on a key win
    b.commit()
    assert db[b"k"] == b"2"


def test_conditional_writes(db):
    assert db.insert_if_absent(b"k", b"1") is True
    assert db.insert_if_absent(b"k", b"2") is False
    assert db[b"k"] == b"1"
    assert db.update_if_present(b"k", b"3") is True
    assert db.update_if_present(b"nope", b"3") is False
    assert db[b"k"] == b"3" and b"nope" not in db


def test_ranges(db):
    keys = [b"a", b"ab", b"abc", b"b", b"ba", b"c", b"d"]
    for k in keys:
        db[k] = k.upper()
    assert list(db.keys()) == keys
    assert list(db) == keys
    assert list(db.items()) == [(k, k.upper()) for k in keys]
    assert list(db.values()) == [k.upper() for k in keys]
    assert list(db.keys(start=b"ab", stop=b"c")) == [b"ab", b"abc", b"b", b"ba"]
    assert list(db.keys(start=b"ab", stop=b"c", reverse=True)) == [b"ba", b"b", b"abc", b"ab"]
    assert list(db.keys(prefix=b"a")) == [b"a", b"ab", b"abc"]
    assert list(db.keys(prefix=b"a", reverse=True)) == [b"abc", b"ab", b"a"]
    assert list(db.keys(prefix=b"a", start=b"aa")) == [b"ab", b"abc"]
    assert list(db.keys(prefix=b"b", stop=b"b\x00")) == [b"b"]
    assert list(db.keys(reverse=True)) == keys[::-1]
    assert list(db.keys(start=b"zz")) == []
    assert list(db.keys(start=b"c", stop=b"a")) == []
    assert list(db.keys(prefix=b"\xff")) == []


def test_ranges_over_large_and_many_values(db):
    """Chunked fetching: values over the chunk's byte budget, and many small ones."""
    big = {b"big%d" % i: bytes([i]) * (1_500_000 + i) for i in range(3)}
    for k, v in big.items():
        db[k] = v
    small = {b"s%05d" % i: b"%d" % i for i in range(1000)}
    with db.write_batch() as b:
        for k, v in small.items():
            b.put(k, v)
    assert dict(db.items(prefix=b"big")) == big
    assert list(db.values(prefix=b"big", reverse=True)) == [big[k] for k in sorted(big, reverse=True)]
    assert list(db.items(prefix=b"s")) == sorted(small.items())
    assert list(db.keys(start=b"s00500", reverse=True)) == sorted(small, reverse=True)[:500]


def test_iterator_is_a_snapshot_of_its_call(db):
    for i in range(300):
        db[b"%04d" % i] = b"v"
    it = db.items()
    first = next(it)
    db[b"0000"] = b"changed"
    db[b"9999"] = b"new"
    del db[b"0150"]
    rest = list(it)
    assert first == (b"0000", b"v")
    assert len(rest) == 299 and (b"0150", b"v") in rest and all(k != b"9999" for k, _ in rest)
    it.close()
    assert list(it) == []


def test_snapshot(db):
    db[b"a"] = b"1"
    db[b"b"] = b"2"
    with db.snapshot() as snap:
        db[b"a"] = b"changed"
        del db[b"b"]
        db[b"c"] = b"3"
        assert snap[b"a"] == b"1" and snap.get(b"b") == b"2" and b"c" not in snap
        assert list(snap.items()) == [(b"a", b"1"), (b"b", b"2")]
        assert list(snap.keys(reverse=True)) == [b"b", b"a"]
        assert list(snap) == [b"a", b"b"]
        with pytest.raises(KeyError):
            snap[b"c"]
        it = snap.values()
    assert snap.closed
    with pytest.raises(tierkv.ClosedError):
        snap[b"a"]
    assert list(it) == [b"1", b"2"]  # an iterator outlives its (closed) snapshot
    assert db[b"a"] == b"changed"


@pytest.mark.parametrize("preset", ["native", "pmekv"])
def test_stats_check_compact_flush(path, preset):
    with open_small(path, preset=preset) as db:
        for i in range(100):
            db[b"k%03d" % i] = b"x" * 100
        s = db.stats()
        assert s["preset"] == preset
        assert s["keys"] == 100
        assert s["user_bytes_written"] >= 100 * 104
        assert isinstance(s["design"], dict) and isinstance(s["pm"], dict)
        assert db.check() == []
        db.compact()
        db.flush()
        assert db[b"k050"] == b"x" * 100
        assert db.preset == preset


def test_every_preset_opens_and_snapshots(tmp_path):
    for preset in tierkv.PRESETS:
        with open_small(tmp_path / preset, preset=preset) as db:
            db[b"k"] = b"1"
            snap = db.snapshot()
            db[b"k"] = b"2"
            assert snap[b"k"] == b"1" and db[b"k"] == b"2", preset
            assert list(db.items(prefix=b"k")) == [(b"k", b"2")]


def test_close_reopen_and_durability(path):
    db = open_small(path)
    db[b"k"] = b"v"
    assert not db.closed
    db.close()
    db.close()  # idempotent
    assert db.closed and "closed" in repr(db)
    with open_small(path) as db2:
        assert db2[b"k"] == b"v"


def test_closed_db_raises_closed_error(path):
    db = open_small(path)
    db[b"a"] = b"1"
    db[b"b"] = b"2"
    it = db.items()
    assert next(it) == (b"a", b"1")
    snap = db.snapshot()
    batch = db.write_batch()
    batch.put(b"c", b"3")
    db.close()
    for call in [
        lambda: db[b"a"],
        lambda: db.__setitem__(b"a", b"x"),
        lambda: db.get(b"a"),
        lambda: b"a" in db,
        lambda: db.items(),
        lambda: db.snapshot(),
        lambda: db.stats(),
        lambda: db.check(),
        lambda: db.compact(),
        lambda: next(it),  # an iterator that outlives its Db
        lambda: snap[b"a"],
        lambda: snap.items(),
        batch.commit,
    ]:
        with pytest.raises(tierkv.ClosedError):
            call()
    # The iterator and snapshot objects still exist, but the store is free to reopen.
    with open_small(path) as db2:
        assert db2[b"b"] == b"2" and b"c" not in db2


def test_open_errors(path, tmp_path):
    with tierkv.open(path, preset="native", native={"shards": 4}, pm_pool_size=1 << 22) as db:
        assert db.preset == "native"
        with pytest.raises(tierkv.LockedError):
            tierkv.open(path)
    with pytest.raises(tierkv.InvalidArgument, match="preset"):
        tierkv.open(path, preset="pmekv")
    with pytest.raises(ValueError):
        tierkv.open(path, preset="no-such-preset")
    with pytest.raises(TypeError, match="bogus"):
        tierkv.open(path, bogus=1)
    with pytest.raises(TypeError, match="native.nope"):
        tierkv.open(path, native={"nope": 1})
    with pytest.raises(TypeError, match="native.shards"):
        tierkv.open(path, native={"shards": "many"})
    with pytest.raises(tierkv.InvalidArgument):
        tierkv.open(path, pm_pool_size=3)
    with pytest.raises(tierkv.InvalidArgument):
        tierkv.open(tmp_path / "absent", create_if_missing=False)
    with pytest.raises(tierkv.InvalidArgument):
        tierkv.open(path, error_if_exists=True)
    with pytest.raises(tierkv.InvalidArgument):
        tierkv.open(path, wal_recovery="sometimes")
    with tierkv.open(tmp_path / "p2", pm_path=tmp_path / "pm-elsewhere", pm_pool_size=1 << 24) as db:
        db[b"k"] = b"v"
    assert os.listdir(tmp_path / "pm-elsewhere")


def test_corruption_is_an_exception_not_a_crash(path):
    with open_small(path) as db:
        for i in range(100):
            db[b"key%03d" % i] = b"value-%03d" % i * 10
    pool = sorted(p for p in glob.glob(str(path / "pm" / "*")) if os.path.isfile(p))[0]
    with open(pool, "r+b") as f:
        data = f.read()
        at = data.find(b"value-050")
        assert at > 0
        f.seek(at + 3)
        f.write(b"X")
    # The clean close wrote an index checkpoint, so the open does not replay the damaged
    # record: the first read of the key verifies its checksum, and check() reports it.
    with tierkv.open(path) as db:
        assert db.check(), "check() found nothing"
        with pytest.raises(tierkv.CorruptionError) as e:
            db[b"key050"]
    assert e.value.file == pool and e.value.offset <= at and "checksum" in e.value.detail
    assert isinstance(e.value, tierkv.Error)


def test_interpreter_exit_closes_open_stores(path):
    """A script that never closes its store exits cleanly (the atexit hook closes it, with
    an iterator and a snapshot still open) and its writes are there."""
    import subprocess
    import sys

    code = (
        "import sys, tierkv\n"
        "db = tierkv.open(sys.argv[1], pm_pool_size=1 << 23)\n"
        "db[b'k'] = b'v'\n"
        "it = db.items(); snap = db.snapshot(); next(it)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=120)
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    with open_small(path) as db:
        assert db[b"k"] == b"v"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_leaves_the_parents_store_alone(path):
    """A child made by os.fork() that exits through the interpreter (running atexit hooks)
    does not close or write the store its parent keeps using."""
    with open_small(path) as db:
        db[b"before"] = b"1"
        pid = os.fork()
        if pid == 0:  # the child: exit through the interpreter's normal shutdown
            try:
                import atexit

                atexit._run_exitfuncs()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert status == 0
        db[b"after"] = b"2"
        assert db[b"before"] == b"1" and not db.closed
    with open_small(path) as db:
        assert db[b"before"] == b"1" and db[b"after"] == b"2"
        assert db.check() == []
