"""kill -9: a writer process is SIGKILLed at random moments; every write it acknowledged
(printed after the call returned) must be there after reopening, and nothing it deleted may
come back; the one operation in flight may or may not have happened (a batch wholly or not)."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest

import tierkv
from conftest import REPORT
from crash_ops import ops

HERE = os.path.dirname(os.path.abspath(__file__))


def run_writer(path, cycle, kill_after):
    """Start the writer, kill -9 it after `kill_after` seconds; the acknowledged op count."""
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "crash_writer.py"), str(path), str(cycle)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    # Wait for the first acknowledgement (the store is open), then let it run.
    first = p.stdout.readline()
    assert first == b"0\n", (first, p.stderr.read())
    time.sleep(kill_after)
    p.send_signal(signal.SIGKILL)
    rest = p.stdout.read()
    p.wait()
    assert p.returncode == -signal.SIGKILL, p.stderr.read()
    lines = (first + rest).split(b"\n")
    complete = [line for line in lines[:-1]]  # the last piece is "" or a torn line
    acked = len(complete)
    assert [int(x) for x in complete] == list(range(acked))
    return acked


def expected_state(cycle, acked):
    """(must_have, must_not_have, in_flight): the state the acknowledged ops promise."""
    have, gone = {}, set()
    stream = ops(cycle)
    for _ in range(acked):
        op = next(stream)
        if op[0] == "put":
            have[op[1]] = op[2]
        elif op[0] == "delete":
            have.pop(op[1], None)
            gone.add(op[1])
        else:
            have.update(op[1])
    return have, gone, next(stream)


def verify(db, cycle, acked):
    have, gone, flight = expected_state(cycle, acked)
    keys_in_flight = set()
    if flight[0] == "batch":
        present = [k in db for k, _ in flight[1]]
        assert all(present) or not any(present), "a batch was torn by the crash"
        keys_in_flight = {k for k, _ in flight[1]}
    else:
        keys_in_flight = {flight[1]}
    lost = [k for k, v in have.items() if k not in keys_in_flight and db.get(k) != v]
    assert not lost, "%d acknowledged writes lost or wrong, e.g. %r" % (len(lost), lost[:3])
    back = [k for k in gone if k not in keys_in_flight and k in db]
    assert not back, "deleted keys came back: %r" % back[:3]
    return len(have)


def test_acknowledged_writes_survive_kill_9(tmp_path):
    path = tmp_path / "store"
    rng = random.Random(int(os.environ.get("TIERKV_CRASH_SEED", "24")))
    done = []  # (cycle, acknowledged ops)
    for cycle in range(6):
        done.append((cycle, run_writer(path, cycle, rng.uniform(0.05, 0.6))))
        t = time.perf_counter()
        with tierkv.open(path) as db:
            reopen = time.perf_counter() - t
            # Every cycle so far (each writes its own keys): earlier ones must still hold.
            live = sum(verify(db, c, acked) for c, acked in done)
            assert db.check() == []
    total = sum(a for _, a in done)
    assert total > 100  # the writer got going before it was killed
    REPORT.append(
        "kill -9: 6 SIGKILLs, %d acknowledged operations, all present (%d live keys); last reopen %.3f s"
        % (total, live, reopen)
    )


def test_the_crash_check_can_fail(tmp_path):
    """A lost acknowledged write is reported: remove one after a real crash and verify."""
    path = tmp_path / "store"
    acked = run_writer(path, 0, 0.2)
    have, _, _ = expected_state(0, acked)
    with tierkv.open(path) as db:
        verify(db, 0, acked)
        victim = sorted(have)[len(have) // 2]
        del db[victim]
        with pytest.raises(AssertionError, match="acknowledged writes lost"):
            verify(db, 0, acked)
