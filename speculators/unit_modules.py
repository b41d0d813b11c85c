"""Declared units (algorithms, verifier families, training objectives) are one module each inside a package whose
``__init__`` holds the registry. The registry imports every module of its package once, on its first lookup, so
adding a unit is adding a file: nothing else lists the modules."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable

# packages whose modules are all imported (a module may also be imported directly)
_IMPORTED: set[str] = set()


def import_unit_modules(package: str, path: Iterable[str]) -> None:
    """Import every module of ``package`` (its ``__path__`` is ``path``) unless done before."""
    if package in _IMPORTED:
        return
    for module in pkgutil.iter_modules(path):
        importlib.import_module(f"{package}.{module.name}")
    _IMPORTED.add(package)
