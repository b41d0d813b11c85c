"""Scaffolding the tests and the benchmarks share, kept out of the library: tiny random verifiers
(:mod:`tests.support.verifiers`), a quickly self-distilled draft (:mod:`tests.support.quickfit`) and an exact
live-tensor memory counter (:mod:`tests.support.memory`). Benchmarks import it with the repository root on
``sys.path``, as they import everything else of the checkout."""
