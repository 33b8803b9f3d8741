"""Random generators of every kind, made with a seed and without one: what each engine's copies
must draw (their own numbers from each made without a seed, the same from each seeded one).

Works with the numpy of the host (2.x) and of the VM guest (Debian's 1.24, which has no
``Generator.spawn``: sequences are spawned from a ``SeedSequence`` instead).
"""

from __future__ import annotations

import ast

# A snapshot's setup. A function's local generator is made and dropped too: it must leave nothing
# behind to trace or hold.
SETUP = """
import random
import numpy as np
own, own_seeded = random.Random(), random.Random(42)
rng, rng_seeded = np.random.default_rng(), np.random.default_rng(42)
pcg = np.random.Generator(np.random.PCG64())
legacy, legacy_seeded = np.random.RandomState(), np.random.RandomState(42)
legacy.standard_normal()  # leaves its second Gaussian cached
seq = np.random.SeedSequence()
philox = np.random.Philox(key=7)
def local_draw():
    return np.random.default_rng().random()
local_draw()
"""

# name: (made without a seed?, an expression drawing from it)
DRAWS = {"Random()": (True, "own.random()"), "Random(42)": (False, "own_seeded.random()"),
         "default_rng()": (True, "float(rng.random())"), "default_rng(42)": (False, "float(rng_seeded.random())"),
         "Generator(PCG64())": (True, "float(pcg.random())"),
         "RandomState()": (True, "float(legacy.standard_normal())"),
         "RandomState(42)": (False, "float(legacy_seeded.random())"),
         "SeedSequence().spawn()": (True, "int(seq.spawn(1)[0].generate_state(1)[0])"),
         "Philox(key=7)": (False, "int(philox.random_raw())")}

# A cell run in a sandbox before it is branched.
LATER_CODE = ("cell_rng = np.random.default_rng()\n"
              "spawned = [np.random.default_rng(s) for s in seq.spawn(2)]\n"
              "from_seq = np.random.default_rng(seq)\n"
              "cell_own = random.Random()\n"
              "replayed = random.Random(); replayed.setstate(own_seeded.getstate())")
LATER = {"cell default_rng()": (True, "float(cell_rng.random())"),
         "default_rng(seq.spawn())": (True, "float(spawned[1].random())"),
         "default_rng(seq)": (True, "float(from_seq.random())"),
         "cell Random()": (True, "cell_own.random()"),
         "Random().setstate()": (False, "replayed.random()")}
ALL = {**DRAWS, **LATER}


def _draw(table: dict) -> str:
    """One expression drawing from every generator of ``table``: a list, in its order."""
    return "[" + ", ".join(expr for _, expr in table.values()) + "]"


DRAW = _draw(DRAWS)
DRAW_ALL = _draw(ALL)


def assert_own(table: dict, *results: str) -> None:
    """``results``: the repr of DRAW (or DRAW_ALL) evaluated in each copy, at the same point."""
    rows = [ast.literal_eval(r) for r in results]
    for i, (name, (unseeded, _)) in enumerate(table.items()):
        values = [row[i] for row in rows]
        if unseeded:
            assert len(set(values)) == len(values), (name, values)  # each copy its own stream
        else:
            assert len(set(values)) == 1, (name, values)            # seeded on purpose: the same
