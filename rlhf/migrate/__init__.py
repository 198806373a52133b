"""``python -m rlhf.migrate``: DeepSpeed-Chat launch scripts and DeepSpeed ``ds_config.json`` files
in, ``python -m rlhf stage=...`` command lines out, with every flag or key that has no target and
why.

- ``script``: reads a launch script's text (``deepspeed [launcher args] .../main.py --flag value
  ...``,
  backslash continuations, simple ``NAME=value`` assignments and ``$1`` defaults) into invocations.
- ``flags``: one table of DeepSpeed-Chat's step-1/2/3 flags (and step-2 DPO's), each with its
  target.
- ``ds_config``: one table of ``ds_config.json`` keys, each with its target.
- ``plan``: the command being built (overrides, notes, what is left unmapped) and how it prints.
- ``__main__``: the command line, and ``reward-model SRC DST`` (a DeepSpeed-Chat reward model
  converted
  to a sequence classifier, ``rlhf.models.dschat``).

The flag table of docs/deepspeed.md is this package's tables, in prose.
"""
