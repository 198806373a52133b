"""A fault for testing the injection itself: marks ``rlhf.errors`` when it is imported."""

from sitecustomize import after_import


def install(arg: str) -> None:
    after_import("rlhf.errors", lambda m: setattr(m, "INJECTED", arg))
