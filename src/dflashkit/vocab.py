"""Token facts the drafter depends on: stop tokens and the mask token (docs/conventions.md, "Block")."""

from __future__ import annotations

from typing import Any


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> set[int]:
    """EOS of the tokenizer plus every EOS of the generation config."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is not None:
        ids.update(int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ids


def reserved_token_ids(tokenizer: Any, generation_config: Any = None) -> set[int]:
    """Tokens a mask id must never equal: BOS, EOS, PAD, UNK and stop tokens."""
    ids = stop_token_ids(tokenizer, generation_config)
    for attr in ("bos_token_id", "pad_token_id", "unk_token_id"):
        v = getattr(tokenizer, attr, None)
        if v is not None:
            ids.add(int(v))
    return ids


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return " ".join(template.values()) if isinstance(template, dict) else template


def _unused_special_tokens(tokenizer: Any, reserved: set[int]) -> list[int]:
    """Special tokens that are not reserved and that the chat template never writes."""
    template = _template_text(tokenizer)
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return sorted(i for i, t in decoder.items()
                  if getattr(t, "special", False) and i not in reserved and str(t) not in template)


def default_mask_token_id(tokenizer: Any, embedding_rows: int, generation_config: Any = None) -> int:
    """First unused embedding row; else the tokenizer's mask token; else the last special token
    that text and chat never use (SmolLM2: `<empty_output>`, id 16)."""
    reserved = reserved_token_ids(tokenizer, generation_config)
    if embedding_rows > len(tokenizer):
        return len(tokenizer)
    mask = getattr(tokenizer, "mask_token_id", None)
    if mask is not None and mask not in reserved:
        return int(mask)
    unused = _unused_special_tokens(tokenizer, reserved)
    if not unused:
        raise ValueError("cannot choose a mask token: the embedding has no spare rows, the tokenizer has no mask token "
                         "and no unused special token; pass drafter.mask_token_id explicitly")
    return unused[-1]


def mask_token_problems(mask_id: int, tokenizer: Any, embedding_rows: int, generation_config: Any = None) -> list[str]:
    """Readable reasons why `mask_id` is unsafe (empty when it is fine)."""
    problems = []
    if not 0 <= mask_id < embedding_rows:
        problems.append(f"mask_token_id {mask_id} is outside the target's embedding (0..{embedding_rows - 1})")
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    if mask_id in reserved_token_ids(tokenizer, generation_config):
        problems.append(f"mask_token_id {mask_id} is a BOS/EOS/PAD/stop token: decoders scan their output for stop "
                        "tokens and would stop after one round; choose an unused special token")
    elif mask_id < len(tokenizer) and mask_id not in decoder and mask_id != getattr(tokenizer, "mask_token_id", None):
        problems.append(f"mask_token_id {mask_id} ({tokenizer.convert_ids_to_tokens(mask_id)!r}) is an ordinary text "
                        "token; choose an unused special token or a spare embedding row")
    elif mask_id in decoder and str(decoder[mask_id]) in _template_text(tokenizer):
        problems.append(f"mask_token_id {mask_id} ({str(decoder[mask_id])!r}) is written by the chat template, so it "
                        "occurs in every conversation; choose a special token the template never writes")
    return problems
