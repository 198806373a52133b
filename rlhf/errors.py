"""User-facing errors: bad configuration or bad input, and a save that could not be written.

Anything raised as ``UserError`` ends the program with exit code 2 and one line on stderr, a
``SaveError`` with exit code 4 (docs/contract.md, "Exit codes"). Every other exception is a bug and
keeps its traceback.
"""

EXIT_SAVE = 4


class UserError(Exception):
    """Bad configuration or bad input; the message says what and where, in one line."""


class ConfigError(UserError):
    """An invalid configuration value."""


class DataError(UserError):
    """A malformed data file or record."""


class SaveError(Exception):
    """A checkpoint or an export could not be written (disk full, quota, I/O error). Not a
    UserError: the input was fine and a rerun, once there is room, resumes from the last complete
    checkpoint, which the failed save left intact. The message names what was being saved, the error
    and that checkpoint, in one line."""

    exit_code = EXIT_SAVE


def one_of(items, joined_by: str = "or") -> str:
    """Names for a message: ``one_of(["gae", "grpo", "rloo"])`` → 'gae, grpo or rloo'."""
    items = list(items)
    if len(items) == 1:
        return items[0]
    return f"{', '.join(items[:-1])} {joined_by} {items[-1]}"


def first_line(e: BaseException) -> str:
    """An exception's text, stripped, up to its first line break; its type's name when it has
    none."""
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
