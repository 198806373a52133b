"""Safety properties of the code base, checked by scanning the source (so a regression fails here).

- every ``torch.load`` passes ``weights_only=True``; nothing imports pickle or a pickle-based
  serialiser, and no loader is asked to allow pickles;
- remote code never runs unless the user sets ``model.trust_remote_code=true``: no
  ``trust_remote_code`` argument anywhere is a literal True or comes from anywhere but that key
  (or a helper's parameter of the same name, default False), and every Hugging Face loading call
  passes it on (known exceptions, all with remote code off, listed in KNOWN_UNTHREADED);
- the tokenized-data cache is safetensors + JSON.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("rlhf", "stages", "bench", "scripts")

PICKLE_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "dill",
    "cloudpickle",
    "joblib",
    "shelve",
    "marshal",
}
HF_LOADERS = {"from_pretrained"}
# The project's helpers that reach from_pretrained, and where their trust_remote_code argument sits.
HELPERS = {"load_model_config": 1, "load_tokenizer": 1, "build_model": None}
# Files whose job is to run code they are given: the sandboxed interpreter runs the Python tool's
# code (inside the sandbox's namespaces, limits and guard)
RUNS_CODE = {"rlhf/envs/sandbox/guard.py"}
# Helper calls that do not thread model.trust_remote_code (safe: remote code stays off), reported
# for their owners; (file, enclosing function, callee). Keep this list shrinking.
KNOWN_UNTHREADED = {
    (
        "stages/sft.py",
        "tokenizer_and_config",
        "load_tokenizer",
    ): "the embedded tokenizer re-read from our own checkpoint",
}


def _sources() -> List[Path]:
    files = []
    for d in SOURCE_DIRS:
        files += sorted((ROOT / d).rglob("*.py"))
    assert files, "no source files found"
    return files


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _calls(tree: ast.AST) -> Iterator[Tuple[ast.Call, Optional[str]]]:
    """Every call with the name of the function (def) it sits in."""

    def walk(node, func):
        for child in ast.iter_child_nodes(node):
            inner = (
                child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            )
            if isinstance(child, ast.Call):
                yield child, func
            yield from walk(child, inner)

    yield from walk(tree, None)


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _dotted(node: ast.AST) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # pragma: no cover
        return ""


def _kw(call: ast.Call, name: str) -> Optional[ast.AST]:
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def _parsed():
    for path in _sources():
        yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_torch_load_is_weights_only():
    seen, bad = 0, []
    for path, tree in _parsed():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "torch"
                and any(a.name == "load" for a in node.names)
            ):
                bad.append(f"{_rel(path)}:{node.lineno} from torch import load (call torch.load)")
            if isinstance(node, ast.Call) and _dotted(node.func) == "torch.load":
                seen += 1
                v = _kw(node, "weights_only")
                if not (isinstance(v, ast.Constant) and v.value is True):
                    bad.append(f"{_rel(path)}:{node.lineno}")
    assert seen, "expected at least one torch.load (the checkpoint's RNG state)"
    assert not bad, f"torch.load without weights_only=True at {bad}"


def test_no_pickle_serialisers():
    bad = []
    for path, tree in _parsed():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            bad += [f"{_rel(path)}:{node.lineno} imports {n}" for n in names if n in PICKLE_MODULES]
            if isinstance(node, ast.Call):
                allow = _kw(node, "allow_pickle")
                if allow is not None and not (
                    isinstance(allow, ast.Constant) and allow.value is False
                ):
                    bad.append(f"{_rel(path)}:{node.lineno} allow_pickle")
                if _callee(node) in ("read_pickle", "to_pickle"):
                    bad.append(f"{_rel(path)}:{node.lineno} {_callee(node)}")
                if (
                    isinstance(node.func, ast.Name)
                    and node.func.id in ("eval", "exec")
                    and _rel(path) not in RUNS_CODE
                ):
                    bad.append(f"{_rel(path)}:{node.lineno} {node.func.id}()")
                if _dotted(node.func) == "yaml.load" and _kw(node, "Loader") is None:
                    bad.append(f"{_rel(path)}:{node.lineno} yaml.load without a safe Loader")
    assert not bad, bad


def _trust_ok(value: ast.AST) -> bool:
    """A trust_remote_code value that cannot turn remote code on by itself."""
    if isinstance(value, ast.Constant):
        return value.value is False
    # the config key, a parameter passing it on, or the scorer's opt-in CLI flag
    text = _dotted(value)
    return text in ("trust_remote_code", "args.trust_remote_code") or text.endswith(
        "model.trust_remote_code"
    )


def test_trust_remote_code_only_from_the_config_key():
    bad = []
    for path, tree in _parsed():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                v = _kw(node, "trust_remote_code")
                if v is not None and not _trust_ok(v):
                    bad.append(f"{_rel(path)}:{node.lineno} trust_remote_code={_dotted(v)}")
                if (
                    _callee(node) in HELPERS
                    and HELPERS[_callee(node)] is not None
                    and len(node.args) > HELPERS[_callee(node)]
                ):
                    v = node.args[HELPERS[_callee(node)]]
                    if not _trust_ok(v):
                        bad.append(f"{_rel(path)}:{node.lineno} {_callee(node)}(..., {_dotted(v)})")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.args + node.args.kwonlyargs
                defaults = (
                    [None] * (len(node.args.args) - len(node.args.defaults))
                    + node.args.defaults
                    + node.args.kw_defaults
                )
                for a, d in zip(args, defaults):
                    if (
                        a.arg == "trust_remote_code"
                        and d is not None
                        and not (isinstance(d, ast.Constant) and d.value is False)
                    ):
                        bad.append(
                            f"{_rel(path)}:{node.lineno} "
                            f"{node.name}(trust_remote_code={_dotted(d)})"
                        )
    assert not bad, bad


def _passes_trust(call: ast.Call) -> bool:
    if _kw(call, "trust_remote_code") is not None:
        return True
    pos = HELPERS.get(_callee(call))
    return pos is not None and len(call.args) > pos


def _helper_names(tree: ast.AST) -> set:
    """Names under which a file calls the loading helpers: ``loading.X`` or ``from ...loading import
    X``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "rlhf.models.loading":
            names |= {a.asname or a.name for a in node.names if a.name in HELPERS}
    return names


def test_every_hf_load_passes_trust_remote_code():
    """from_pretrained / from_config and the project's loading helpers pass the flag on (a missing
    flag means Transformers' default, False: safe, but model.trust_remote_code would not reach
    it)."""
    missing = {}
    for path, tree in _parsed():
        rel = _rel(path)
        imported = _helper_names(tree)
        for call, func in _calls(tree):
            name = _callee(call)
            is_hf = name in HF_LOADERS or (
                name == "from_config" and rel == "rlhf/models/loading.py"
            )
            is_helper = name in HELPERS and (
                (isinstance(call.func, ast.Attribute) and _dotted(call.func.value) == "loading")
                or (isinstance(call.func, ast.Name) and name in imported)
            )
            if (is_hf or is_helper) and not _passes_trust(call):
                missing[(rel, func, name)] = f"{rel}:{call.lineno}"
    unexpected = {k: v for k, v in missing.items() if k not in KNOWN_UNTHREADED}
    assert not unexpected, (
        f"loading calls that drop model.trust_remote_code: {sorted(unexpected.values())}"
    )


def test_loading_helpers_thread_their_parameter():
    """Inside rlhf/models/loading.py every Hugging Face call passes
    trust_remote_code=trust_remote_code."""
    tree = ast.parse((ROOT / "rlhf/models/loading.py").read_text())
    calls = [c for c, _ in _calls(tree) if _callee(c) in ("from_pretrained", "from_config")]
    assert len(calls) >= 4
    for c in calls:
        v = _kw(c, "trust_remote_code")
        assert v is not None and _dotted(v) == "trust_remote_code", (
            f"rlhf/models/loading.py:{c.lineno}"
        )


def test_trust_remote_code_key_exists_and_is_off():
    from rlhf.compose import compose_config
    from rlhf.config import ModelConfig

    assert ModelConfig().trust_remote_code is False
    assert compose_config(["stage=sft"])[0].model.trust_remote_code is False
    assert (
        compose_config(["stage=sft", "model.trust_remote_code=true"])[0].model.trust_remote_code
        is True
    )


def test_data_cache_is_safetensors_and_json(tmp_path):
    """The tokenized-data cache writes only .safetensors and .json files and reads them back."""
    from rlhf.data.records import Example
    from rlhf.data.tokenize import cached
    from rlhf.engine.mesh import Mesh

    class Tok:
        # what the cache key needs of a tokenizer
        bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

        def get_vocab(self):
            return {"a": 3}

    examples = [Example(prompt="p", response="r")]
    cols = cached(
        "sft",
        examples,
        Tok(),
        {"max_prompt": 4},
        tmp_path,
        Mesh(),
        lambda: {"ids": [[1, 3, 2]], "prompt_len": [1]},
    )
    assert cols == {"ids": [[1, 3, 2]], "prompt_len": [1]}
    suffixes = sorted(p.suffix for p in tmp_path.iterdir())
    assert suffixes == [".json", ".safetensors"], suffixes
