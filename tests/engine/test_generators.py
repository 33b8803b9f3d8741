"""Which generators a copy reseeds, and what noting them costs, in a plain Python process that
installs the notes first (as the agent does) and copies itself with os.fork."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("numpy")

PRELUDE = """
import gc, json, os, random, sys
from forkd_engine.agent import generators
generators.install()
import numpy as np

def in_copies(fn, n=2):
    '''fn() in n forks of this process, each reseeded first as the agent does; their results.'''
    out = []
    for _ in range(n):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            generators.reseed()
            os.write(w, json.dumps(fn()).encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            out.append(json.load(f))
        os.waitpid(pid, 0)
    return out

def known():
    return sorted(type(entry[0]).__name__ for entry in generators._known.values())
"""


def script(body: str) -> dict:
    code = PRELUDE + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_numpy_imported_after_install_notes_what_it_draws():
    got = script("""
        from numpy.random import bit_generator
        g = np.random.default_rng()
        generators.notice()
        print(json.dumps({"wrapped": getattr(bit_generator.randbits, "forkd_notes", False),
                          "known": known(),
                          "finder_left": any(type(f).__name__ == "_NumpyFinder" for f in sys.meta_path)}))
    """)
    # the generator, its sequence and their entropy; numpy's own global is not among them
    assert got == {"wrapped": True, "known": ["PCG64", "SeedSequence", "int"], "finder_left": False}


def test_copies_of_copies_draw_their_own_numbers_and_seeded_ones_agree():
    got = script("""
        rng, seeded, own = np.random.default_rng(), np.random.default_rng(1), random.Random()
        generators.notice()
        def draws():
            return [float(rng.random()), float(seeded.random()), own.random()]
        first = in_copies(lambda: in_copies(draws))  # two copies, each copied twice
        print(json.dumps({"grandchildren": [d for pair in first for d in pair], "here": draws()}))
    """)
    rows = got["grandchildren"] + [got["here"]]
    for column, unseeded in zip(zip(*rows), (True, False, True)):
        assert len(set(column)) == (len(rows) if unseeded else 1), column


def test_a_copy_leaves_numpy_random_unimported_until_used_and_then_draws_its_own():
    got = script("""
        if "numpy.random" in sys.modules:  # numpy 1 imports it with numpy: nothing is left to test
            print(json.dumps(None))
            sys.exit(0)
        def first_use():
            imported = "numpy.random" in sys.modules
            return [imported, float(np.random.random())]
        print(json.dumps(in_copies(first_use, 3)))
    """)
    if got is None:
        pytest.skip("this numpy imports numpy.random with numpy")
    # nothing to reseed in a copy before numpy.random exists (importing it there cost each copy
    # 20 ms); each copy's first use seeds its own
    assert [imported for imported, _ in got] == [False, False, False]
    assert len({value for _, value in got}) == 3


def test_what_was_dropped_or_never_kept_costs_nothing():
    got = script("""
        def local():
            return np.random.default_rng().random()
        for _ in range(100):
            local()
        generators.notice()
        after_locals = known()
        rng = np.random.default_rng()
        generators.notice()
        while_held = known()
        del rng
        generators.notice()
        print(json.dumps({"after_locals": after_locals, "while_held": while_held, "after_del": known(),
                          "pending": len(generators._pending)}))
    """)
    assert got == {"after_locals": [], "while_held": ["PCG64", "SeedSequence", "int"], "after_del": [],
                   "pending": 0}


def test_a_known_generator_that_gains_a_holder_is_traced_again():
    got = script("""
        seq = np.random.SeedSequence()
        rng = np.random.default_rng()
        generators.notice()
        before = known()
        from_seq = np.random.default_rng(seq)   # a new bit generator holding a known sequence
        spawned = rng.spawn(1)[0]               # a new sequence holding a known entropy
        generators.notice()
        after = known()
        draws = in_copies(lambda: [float(from_seq.random()), float(spawned.random())])
        print(json.dumps({"before": before, "after": after, "differ": [a != b for a, b in zip(*draws)]}))
    """)
    assert got["before"] == ["PCG64", "SeedSequence", "SeedSequence", "int", "int"]
    assert got["after"] == ["PCG64", "PCG64", "PCG64", "SeedSequence", "SeedSequence", "SeedSequence",
                            "int", "int"]
    assert got["differ"] == [True, True]


def test_a_random_seeded_or_given_a_state_later_keeps_its_stream():
    got = script("""
        later_seeded, restored, plain = random.Random(), random.Random(), random.Random()
        later_seeded.seed(5)
        restored.setstate(random.Random(9).getstate())
        import copy
        copied = copy.deepcopy(random.Random(3))
        class Unhashable(random.Random):
            __hash__ = None
        odd = Unhashable()
        draws = in_copies(lambda: [later_seeded.random(), restored.random(), copied.random(), plain.random(),
                                   odd.random()])
        print(json.dumps([a == b for a, b in zip(*draws)]))
    """)
    assert got == [True, True, True, False, False]
