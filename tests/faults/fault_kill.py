"""SIGKILL at a chosen point: ``kill:<module>:<attribute>:<n>:<before|after>`` kills the process
just before or just after the n-th call (1-based) of ``<module>.<attribute>`` (``Class.method``
allowed) — a seeded point of the run (mid-step, mid-save, mid-export, the switch to inference)
instead of a timer's race."""

import functools
import os
import signal

from sitecustomize import after_import


def install(arg: str) -> None:
    module, attr, n, when = arg.split(":")
    n, calls = int(n), [0]
    owner_path, _, name = attr.rpartition(".")

    def patch(mod):
        owner = mod
        for part in filter(None, owner_path.split(".")):
            owner = getattr(owner, part)
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*a, **kw):
            calls[0] += 1
            if calls[0] == n and when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            out = original(*a, **kw)
            if calls[0] == n and when == "after":
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        setattr(owner, name, wrapper)

    after_import(module, patch)
