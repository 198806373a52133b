"""Environments for multi-turn rollouts (docs/agents.md): the API (base), the built-in environments
(builtin), tools as JSON-schema functions (tools), tool-call parsing (toolcalls) and the sandbox the
Python tool runs code in (sandbox)."""
