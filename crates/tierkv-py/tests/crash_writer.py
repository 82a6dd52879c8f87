"""The writer of test_crash.py: applies `ops(cycle)` to the store and prints one line per
operation after the call returned (its acknowledgement), until it is killed."""

import sys

import tierkv

from crash_ops import ops

path, cycle = sys.argv[1], int(sys.argv[2])
db = tierkv.open(path)
out = sys.stdout
for i, op in enumerate(ops(cycle)):
    if op[0] == "put":
        db[op[1]] = op[2]
    elif op[0] == "delete":
        del db[op[1]]
    else:
        with db.write_batch() as b:
            for k, v in op[1]:
                b.put(k, v)
    out.write("%d\n" % i)
    out.flush()
