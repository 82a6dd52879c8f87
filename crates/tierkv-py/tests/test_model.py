"""A model test: random puts, deletes, batches (committed or discarded), reopens, snapshots
and iterator ranges against a `dict`, with hypothesis."""

import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import tierkv
from conftest import SMALL

# Few distinct short keys, so operations collide and prefixes share.
keys = st.binary(min_size=0, max_size=3).map(lambda b: bytes(x % 4 for x in b))
values = st.binary(max_size=40)
bounds = st.one_of(st.none(), keys)
batch_ops = st.lists(st.tuples(st.booleans(), keys, values), max_size=8)

SETTINGS = settings(
    max_examples=80,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def expected_range(model, start, stop, prefix, reverse):
    ks = sorted(
        k
        for k in model
        if (start is None or k >= start) and (stop is None or k < stop) and (prefix is None or k.startswith(prefix))
    )
    return ks[::-1] if reverse else ks


class StoreVsDict(RuleBasedStateMachine):
    """Every rule applies one operation to the store and to the model."""

    PRESET = "native"

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="tierkv-model-")
        self.db = self.open()
        self.model = {}
        self.snaps = []  # (snapshot, frozen copy of the model)

    def open(self):
        return tierkv.open(self.dir, preset=self.PRESET, **SMALL[self.PRESET])

    def teardown(self):
        self.db.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(k=keys, v=values)
    def put(self, k, v):
        self.db[k] = v
        self.model[k] = v

    @rule(k=keys)
    def delete(self, k):
        del self.db[k]
        self.model.pop(k, None)

    @rule(ops=batch_ops, fail=st.booleans())
    def batch(self, ops, fail):
        try:
            with self.db.write_batch() as b:
                for is_put, k, v in ops:
                    if is_put:
                        b.put(k, v)
                    else:
                        b.delete(k)
                if fail:
                    raise KeyboardInterrupt  # discarded: the model is unchanged
        except KeyboardInterrupt:
            return
        for is_put, k, v in ops:
            if is_put:
                self.model[k] = v
            else:
                self.model.pop(k, None)

    @rule(k=keys)
    def get(self, k):
        assert self.db.get(k) == self.model.get(k)
        assert (k in self.db) == (k in self.model)

    @rule(start=bounds, stop=bounds, prefix=st.one_of(st.none(), st.binary(max_size=2).map(lambda b: bytes(x % 4 for x in b))), reverse=st.booleans())
    def scan(self, start, stop, prefix, reverse):
        want = expected_range(self.model, start, stop, prefix, reverse)
        got = list(self.db.items(start=start, stop=stop, prefix=prefix, reverse=reverse))
        assert got == [(k, self.model[k]) for k in want]

    @rule()
    def reopen(self):
        for s, _ in self.snaps:
            s.close()
        self.snaps = []
        self.db.close()
        self.db = self.open()

    @precondition(lambda self: len(self.snaps) < 3)
    @rule()
    def snapshot(self):
        self.snaps.append((self.db.snapshot(), dict(self.model)))

    @precondition(lambda self: self.snaps)
    @rule(start=bounds, reverse=st.booleans())
    def check_snapshot(self, start, reverse):
        snap, frozen = self.snaps[-1]
        want = expected_range(frozen, start, None, None, reverse)
        assert list(snap.items(start=start, reverse=reverse)) == [(k, frozen[k]) for k in want]

    @invariant()
    def same_keys(self):
        assert list(self.db.keys()) == sorted(self.model)


@pytest.mark.parametrize("preset", ["native", "pmekv"])
def test_store_matches_dict(preset):
    machine = type("StoreVsDict_" + preset, (StoreVsDict,), {"PRESET": preset})
    run_state_machine_as_test(machine, settings=SETTINGS)


class LossyStore:
    """A store wrapper with a planted bug: a delete of a key ending in 0x01 or 0x03 is lost."""

    def __init__(self, db):
        self._db = db

    def __delitem__(self, k):
        if not (k.endswith(b"\x01") or k.endswith(b"\x03")):
            del self._db[k]

    def __getattr__(self, name):
        return getattr(self._db, name)

    def __setitem__(self, k, v):
        self._db[k] = v

    def __contains__(self, k):
        return k in self._db


class LossyVsDict(StoreVsDict):
    def open(self):
        return LossyStore(tierkv.open(self.dir, **SMALL["native"]))


def test_model_test_catches_a_lost_delete():
    """The model test can fail: with a planted lost-delete bug it finds a counterexample."""
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            LossyVsDict,
            settings=settings(
                SETTINGS,
                max_examples=200,
                database=None,
                derandomize=True,  # the same examples every run: this test must not flake
                phases=[Phase.generate],  # no shrinking: only "it fails" matters
            ),
        )
