"""The Hugging Face hub, asked once whether it can be reached.

A setting that names a hub id (``data.path=Anthropic/hh-rlhf``, ``model.path=Qwen/Qwen2.5-0.5B``)
and is no local path sends ``datasets`` / ``transformers`` to the hub. Offline, they retry with
backoff: measured on a machine without network, ``data.path=Anthropic/hh-rlhf`` printed five
"Retrying in 8s" lines (twice) and failed after about 30 s. Here, before anything loads, one TCP
connection to the hub's host (``HF_ENDPOINT``, default huggingface.co:443) with a short timeout
answers it; where it fails the process works offline (``HF_HUB_OFFLINE=1``,
``HF_DATASETS_OFFLINE=1``): a hub id in the local cache still loads, any other fails at once with
the libraries' own offline error, and the log says why.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from typing import Iterable, Optional, Tuple
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_answer: Optional[Tuple[bool, str]] = None  # one probe per process


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _endpoint() -> Tuple[str, int]:
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


def _connect(host: str, port: int, timeout: float) -> str:
    """ "" when a TCP connection opens, else why not. Name resolution runs in a thread joined with
    the timeout too: a resolver without network can hang far longer than the socket's own
    timeout."""
    result = ["timed out"]

    def attempt():
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result[0] = ""
        except OSError as e:
            result[0] = " ".join(str(e).split()) or type(e).__name__

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(timeout + 0.5)
    return result[0]


def offline_why() -> str:
    """Why this process works offline, for an error about a hub id that did not load ("" when
    online)."""
    if not offline():
        return ""
    if _answer is not None and not _answer[0]:
        return f"working offline: the hub cannot be reached ({_answer[1]})"
    return "working offline: HF_HUB_OFFLINE=1"


def reachable(timeout: float = PROBE_TIMEOUT_S) -> Tuple[bool, str]:
    """(True, "") when the hub answers; (False, why) when it does not or the process is offline."""
    global _answer
    if offline():
        return False, "HF_HUB_OFFLINE=1"
    if _answer is None:
        host, port = _endpoint()
        failed = _connect(host, port, timeout)
        _answer = (True, "") if not failed else (False, f"{host}:{port}: {failed}")
    return _answer


def go_offline() -> None:
    """HF_HUB_OFFLINE / HF_DATASETS_OFFLINE for this process and its children; the libraries read
    them when they load, so a module loaded already gets its constant set too."""
    import sys

    for var in OFFLINE_VARS:
        os.environ[var] = "1"
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:
        hub.HF_HUB_OFFLINE = True
    ds = sys.modules.get("datasets.config")
    if ds is not None:
        ds.HF_HUB_OFFLINE = True
        if hasattr(ds, "HF_DATASETS_OFFLINE"):
            ds.HF_DATASETS_OFFLINE = True


def looks_like_hub_id(value: str, file_suffixes: Tuple[str, ...] = ()) -> bool:
    """``name`` or ``org/name`` that is no local path (what the libraries would look up on the hub)
    and does not end with one of ``file_suffixes`` (a data file's name, mistyped or not there
    yet)."""
    return (
        bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", value))
        and not value.startswith(".")
        and not (file_suffixes and value.endswith(file_suffixes))
        and not os.path.exists(os.path.expanduser(value))
    )


def settle(hub_ids: Iterable[str]) -> str:
    """Given the settings that name hub ids (``key=id`` strings; none: nothing is asked), works
    offline when the hub cannot be reached. Returns the line the log gives ("" when there is nothing
    to say)."""
    hub_ids = list(hub_ids)
    if not hub_ids or offline():
        return ""
    ok, why = reachable()
    if ok:
        return ""
    go_offline()
    return (
        f"the Hugging Face hub cannot be reached ({why}): working offline, hub ids "
        f"({', '.join(hub_ids)}) load from the local hub cache only (HF_HUB_OFFLINE=1 "
        "skips this check)"
    )
