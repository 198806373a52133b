"""User-facing errors: bad configuration or bad input.

Anything raised as ``UserError`` ends the program with exit code 2 and one line on stderr
(docs/contract.md, "Exit codes"). Every other exception is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad configuration or bad input; the message says what and where, in one line."""


class ConfigError(UserError):
    """An invalid configuration value."""


class DataError(UserError):
    """A malformed data file or record."""


def one_of(items, joined_by: str = "or") -> str:
    """Names for a message: ``one_of(["gae", "grpo", "rloo"])`` → 'gae, grpo or rloo'."""
    items = list(items)
    if len(items) == 1:
        return items[0]
    return f"{', '.join(items[:-1])} {joined_by} {items[-1]}"


def first_line(e: BaseException) -> str:
    """An exception's text, stripped, up to its first line break; its type's name when it has none."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    return text.splitlines()[0]


def one_line(msg: str) -> str:
    """Collapse a message to its first non-empty line (Hydra/OmegaConf errors are multi-line)."""
    for line in str(msg).splitlines():
        if line.strip():
            return line.strip()
    return str(msg).strip() or "unknown error"
