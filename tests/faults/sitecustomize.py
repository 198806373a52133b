"""Test-only fault injection into ``python -m rlhf`` subprocesses (never imported by rlhf itself).

A test runs the CLI with ``PYTHONPATH`` starting with this directory and
``RLHF_TEST_FAULT=<name>[:<arg>]`` (``fault_env`` in tests/conftest.py); Python's ``site`` imports
this file at start-up in every process (torchrun's workers too), which imports ``fault_<name>.py``
from here and calls its ``install(arg)``. A fault patches the code it targets once that module is
imported (``after_import``), so the run is the real program up to the injected failure.
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import sys
from typing import Callable, Dict, List


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks on a module right after it is first executed."""

    def __init__(self) -> None:
        self.hooks: Dict[str, List[Callable]] = {}

    def find_spec(self, name, path=None, target=None):
        if name not in self.hooks:
            return None
        # find the real spec, then wrap its loader
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, hooks = spec.loader, self.hooks.pop(name)

        class Wrapped(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                for hook in hooks:
                    hook(module)

        spec.loader = Wrapped()
        return spec


_FINDER = _AfterImport()


def after_import(module_name: str, hook: Callable) -> None:
    """``hook(module)`` once ``module_name`` is imported (now, when it already is)."""
    if module_name in sys.modules:
        hook(sys.modules[module_name])
        return
    _FINDER.hooks.setdefault(module_name, []).append(hook)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


_spec = os.environ.get("RLHF_TEST_FAULT")
if _spec:
    import importlib.util

    _name, _, _arg = _spec.partition(":")
    importlib.import_module(f"fault_{_name}").install(_arg)
