"""Random generators that every copy of a sandbox would otherwise share.

A copy (a process-engine fork, a VM restore) starts with its source's memory, generators included:
a generator that took its seed from the OS when it was made would draw the same numbers in every
copy. ``reseed()`` gives each copy its own streams; a generator the user seeded keeps its stream.

- The global generators (``random``'s, and numpy's legacy ``np.random`` once ``numpy.random`` is
  imported) are always reseeded, as CPython does for ``random`` after ``os.fork``. numpy 2 imports
  ``numpy.random`` on first use; until then no copy shares a global generator, and none imports it.
- ``random.Random`` instances whose last ``seed`` was ``None`` (``Random()`` seeds itself that way):
  ``Random.seed`` and ``Random.setstate`` are wrapped to keep them in a weak mapping; a later
  ``seed(x)`` or ``setstate`` (pickling, ``copy``) takes one off it.
- numpy generators made without a seed (``default_rng()``, ``Generator(PCG64())``,
  ``RandomState()``, ``SeedSequence()``, ...): numpy then draws the entropy of their
  ``SeedSequence`` with ``bit_generator.randbits``, which is wrapped to note each value drawn. One
  given a seed (``default_rng(42)``, ``RandomState(42)``, ``Philox(key=k)``, a pickled copy of a
  seeded one) holds no such value. numpy's objects cannot be weakly referenced and are made in C,
  so after each run of user code (``notice``) the drawn values still alive are traced to the
  ``SeedSequence``s, bit generators and ``RandomState``s that hold them with ``gc.get_referrers``.
  That reads the heap and writes nothing, so pages a sandbox shares with its snapshot stay shared
  (``gc.get_objects`` would write every object's reference count: measured +133 MiB private in a
  fork of a 1M-object heap, ~15 ms to trace either way; ``bench/generators.py``). It runs once per
  generator that outlives the code that made it; a function's local generator costs nothing. The
  objects found are then watched by reference count: one that gains a holder (``rng.spawn()``, a
  generator made from a known ``SeedSequence``) is traced again.

A copy reseeds each ``SeedSequence`` in place with new entropy (its spawn key and children count
kept, so ``spawn`` gives new, independent streams), then sets each bit generator's state from its
sequence; a ``RandomState`` also drops its cached Gaussian. The new entropy is noted like numpy's
own, so the copy's copies are reseeded again.

What stays the source's: a generator made without a seed whose state the user then set by hand
(``bg.state = saved``) is reseeded too (nothing tells that apart), and generators of libraries other
than ``random`` and numpy are not looked for.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import sys
import threading
import weakref

_BIT_GENERATOR = "numpy.random.bit_generator"

_random_seed = random.Random.seed
_c_seed = random.Random.__mro__[1].seed  # _random.Random's own, under random.Random's Python one
_random_setstate = random.Random.setstate
# random.Random instances whose last seed was None, by id (a subclass may be unhashable)
_unseeded: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

_pending: list[int] = []        # entropy numpy drew since the last notice()
_known: dict[int, list] = {}    # id -> [object, its reference count when last looked at]
_lock = threading.Lock()
_installed = False


def install() -> None:
    """Start noting generators made without a seed. Once per process, before user code runs."""
    global _installed
    if _installed:
        return
    _installed = True
    random.Random.seed = _seed
    random.Random.setstate = _setstate
    os.register_at_fork(after_in_child=_renew_lock)
    if _BIT_GENERATOR in sys.modules:
        _wrap_randbits(sys.modules[_BIT_GENERATOR])
    else:
        sys.meta_path.insert(0, _NumpyFinder())


def _renew_lock() -> None:
    global _lock
    _lock = threading.Lock()  # a fork keeps one thread: another one may have held it


def _seed(self, a=None, version=2):
    _random_seed(self, a, version)
    if a is None:
        _unseeded[id(self)] = self
    else:
        _unseeded.pop(id(self), None)


def _setstate(self, state):
    _random_setstate(self, state)
    _unseeded.pop(id(self), None)


_seed.__doc__ = _random_seed.__doc__
_setstate.__doc__ = _random_setstate.__doc__


# --- numpy ---------------------------------------------------------------------------------------

class _NumpyFinder:
    """Wraps ``randbits`` in numpy's bit_generator module as soon as it is imported, before numpy
    (or the user) makes a generator with it."""

    def find_spec(self, name, path, target=None):
        if name != _BIT_GENERATOR:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self)
                return spec
        return None


class _PatchingLoader:
    def __init__(self, loader, finder: _NumpyFinder):
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _wrap_randbits(module)
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self.finder)

    def __getattr__(self, name):  # anything else importlib may ask of a loader
        return getattr(self.loader, name)


def _wrap_randbits(module) -> None:
    draw = getattr(module, "randbits", None)
    if draw is None or getattr(draw, "forkd_notes", False):
        return

    def randbits(k):
        value = draw(k)
        _pending.append(value)  # numpy makes a SeedSequence of it: one made without a seed
        return value

    randbits.forkd_notes = True
    module.randbits = randbits


def _refs(entry: list) -> int:
    """References to ``entry[0]``: 2 (the entry and the call's argument) when only we hold it."""
    return sys.getrefcount(entry[0])


def notice() -> None:
    """After user code ran: find the numpy generators made without a seed that outlived it, and
    the known ones that gained a holder. Cheap when there are none."""
    if _pending or _known:
        with _lock:
            _look()
            _settle()  # after _look returned: no reference of ours but the registry's is left to count


def _look() -> None:
    drawn = []
    while _pending:
        drawn.append([_pending.pop()])
    alive = [entry[0] for entry in drawn if _refs(entry) > 2 and not _is_numpys_global(entry[0])]
    grew = [entry[0] for entry in _known.values() if _refs(entry) > entry[1]]
    for value in alive:
        _known[id(value)] = [value, 0]
    if alive or grew:
        _trace(alive + grew)


def _is_numpys_global(value) -> bool:
    """The entropy of numpy's own global RandomState, made at import: reseeded on its own."""
    mtrand = sys.modules.get("numpy.random.mtrand")
    bg = getattr(getattr(mtrand, "_rand", None), "_bit_generator", None)
    return getattr(getattr(bg, "_seed_seq", None), "entropy", None) is value


def _numpy_types() -> tuple | None:
    bitgen = sys.modules.get(_BIT_GENERATOR)
    if bitgen is None:
        return None
    mtrand = sys.modules.get("numpy.random.mtrand")
    return bitgen.SeedSequence, bitgen.BitGenerator, getattr(mtrand, "RandomState", ())


def _holds(obj, types: tuple):
    """What makes ``obj`` one of ours: a SeedSequence's entropy, a bit generator's sequence, a
    RandomState's bit generator (else None)."""
    seq_type, bitgen_type, state_type = types
    if isinstance(obj, seq_type):
        return obj.entropy
    if isinstance(obj, bitgen_type):
        return getattr(obj, "_seed_seq", None)
    if state_type and isinstance(obj, state_type):
        return getattr(obj, "_bit_generator", None)
    return None


def _ours(obj) -> bool:
    entry = _known.get(id(obj))
    return entry is not None and entry[0] is obj


def _trace(roots: list) -> None:
    """Follow referrers from ``roots`` (drawn entropy, or known objects) to each SeedSequence
    holding a known entropy, bit generator holding a known SeedSequence, and RandomState holding
    a known bit generator. One heap read per level (at most three)."""
    types = _numpy_types()
    frontier = roots if types is not None else []
    while frontier:
        found = []
        for obj in gc.get_referrers(*frontier):
            if not _ours(obj) and _ours(_holds(obj, types)):
                _known[id(obj)] = [obj, 0]
                found.append(obj)
        # Only a RandomState holds a bit generator and caches state of its own, and one made
        # without a seed holds an MT19937: other bit generators need no third heap read.
        frontier = [obj for obj in found if not isinstance(obj, types[1]) or type(obj).__name__ == "MT19937"]


def _settle() -> None:
    """Forget what only the registry still holds (a generator the user dropped: its sequence and
    entropy follow), then note every count. Called with no other reference of ours alive."""
    while True:
        gone = [key for key, entry in _known.items() if _refs(entry) <= 2]
        if not gone:
            break
        for key in gone:
            del _known[key]
    for entry in _known.values():
        entry[1] = _refs(entry)


def _reseed_numpy() -> None:
    types = _numpy_types()
    if types is None:
        return
    seq_type, bitgen_type, state_type = types
    objects = [entry[0] for entry in _known.values()]
    fresh: dict[int, int] = {}  # id of an old entropy -> its replacement
    for obj in objects:
        if isinstance(obj, seq_type) and _ours(obj.entropy):
            new = fresh.setdefault(id(obj.entropy), int.from_bytes(os.urandom(16), "little"))
            seq_type.__init__(obj, new, spawn_key=obj.spawn_key, pool_size=obj.pool_size,
                              n_children_spawned=obj.n_children_spawned)
    for obj in objects:
        if isinstance(obj, bitgen_type) and _ours(getattr(obj, "_seed_seq", None)):
            obj.state = type(obj)(obj._seed_seq).state  # as if made from the reseeded sequence
    for obj in objects:
        if state_type and isinstance(obj, state_type) and _ours(obj._bit_generator):
            state = obj.get_state(legacy=False)
            state["has_gauss"], state["gauss"] = 0, 0.0  # its cached Gaussian was the source's
            obj.set_state(state)
    for new in fresh.values():
        _known[id(new)] = [new, 0]  # noted like numpy's own: this copy's copies reseed again


# --- a copy --------------------------------------------------------------------------------------

def reseed() -> None:
    """In a fresh copy: new streams for the global generators and every one made without a seed."""
    # An int seeds directly (no sha512), and straight into the C seeder: what random.seed adds in
    # Python (type checks, gauss_next) is done here, the rest is code a VM child translates afresh.
    _c_seed(random._inst, int.from_bytes(os.urandom(32), "little"))
    random._inst.gauss_next = None
    # By its module, not np.random: in numpy 2 that would import numpy.random in every copy (20 ms).
    mtrand = sys.modules.get("numpy.random.mtrand")
    if mtrand is not None:
        with contextlib.suppress(Exception):
            mtrand.seed(int.from_bytes(os.urandom(4), "little"))
    if _unseeded:  # iterating a WeakValueDictionary is much Python code; most copies have none
        for r in list(_unseeded.values()):
            _random_seed(r, int.from_bytes(os.urandom(32), "little"))
    if _pending or _known:
        with _lock:
            _look()  # what a cell still running at the copy made
            _reseed_numpy()
            _settle()  # the old entropies, held by nothing now, go
