"""Scaffolding the tests and the benchmarks share, kept out of the library: tiny random verifiers
(:mod:`tests.support.verifiers`), a quickly self-distilled draft (:mod:`tests.support.quickfit`) and an exact
live-tensor memory counter (:mod:`tests.support.memory`) and small in-memory models (:mod:`tests.support.tiny_models`).
Only tests import it (as ``tests.support...``): the benchmarks use the installed packages and add nothing to
``sys.path``."""
