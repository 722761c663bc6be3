"""Chat template + assistant-only loss mask on SmolLM2's template and a Qwen3-style template."""

from __future__ import annotations

import copy
import json

import pytest

from dflashkit.data.chat import (ChatTemplateError, encode, load_tokenized, prompt_ids, tokenize_conversation,
                                 tokenize_file)

# Written for this test (not Qwen's file, which is not available offline): it renders assistant turns
# the way Qwen3's template does, which is what makes loss masks hard. The answer after the last user
# turn gets a <think> block (empty when there is no reasoning), earlier answers lose their reasoning,
# and the generation prompt carries an empty think block when thinking is off.
QWEN3_STYLE = (
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- set reasoning = m.content.split('</think>')[0].split('<think>')[-1].strip('\\n') if '</think>' in m.content else '' -%}"
    "{%- if loop.index0 > ns.last -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


@pytest.fixture(scope="module")
def tok():
    from dflashkit.data.chat import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def qwen_tok(tok):
    t = copy.deepcopy(tok)
    t.chat_template = QWEN3_STYLE
    return t


def supervised_text(tok, s) -> list[str]:
    """Decoded runs of supervised tokens."""
    runs, cur = [], []
    for i, m in zip(s.input_ids, s.loss_mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


CHAT = [{"role": "user", "content": "Say yes or no: is 2+2=4?"}, {"role": "assistant", "content": "yes, 2+2=4."}]
MULTI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
         {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Name a prime."},
         {"role": "assistant", "content": "7 is prime."}]


def test_smollm2_single_turn(tok):
    s = tokenize_conversation(tok, CHAT, max_length=512)
    p = prompt_ids(tok, CHAT[:1])
    # The context is exactly what the target read before answering; the answer and its end token are supervised.
    assert s.input_ids[:len(p)] == p and not any(s.loss_mask[:len(p)])
    assert supervised_text(tok, s) == ["yes, 2+2=4.<|im_end|>"]
    assert tok.decode(s.input_ids[-1:]) == "\n" and s.loss_mask[-1] == 0


def test_smollm2_multi_turn(tok):
    s = tokenize_conversation(tok, MULTI, max_length=512)
    assert supervised_text(tok, s) == ["Hello! How can I help?<|im_end|>", "7 is prime.<|im_end|>"]


def test_qwen3_style_thinking_off(qwen_tok):
    s = tokenize_conversation(qwen_tok, MULTI, max_length=512, thinking=False)
    # Live answer: the empty think block belongs to the prompt (the generation prompt wrote it).
    assert supervised_text(qwen_tok, s) == ["Hello! How can I help?<|im_end|>", "7 is prime.<|im_end|>"]
    text = qwen_tok.decode(s.input_ids)
    assert text.count("<think>") == 1 and text.endswith("<think>\n\n</think>\n\n7 is prime.<|im_end|>\n")


def test_qwen3_style_thinking_on(qwen_tok):
    conv = MULTI[:-1] + [{"role": "assistant", "content": "<think>\nSmall primes: 2, 3, 5, 7.\n</think>\n\n7 is prime."}]
    s = tokenize_conversation(qwen_tok, conv, max_length=512, thinking=True)
    runs = supervised_text(qwen_tok, s)
    # The target wrote the reasoning itself when thinking is on: it is supervised with the answer.
    assert runs == ["Hello! How can I help?<|im_end|>", "<think>\nSmall primes: 2, 3, 5, 7.\n</think>\n\n7 is prime.<|im_end|>"]
    p = prompt_ids(qwen_tok, conv[:-1], thinking=True)
    assert s.input_ids[:len(p)] == p


def test_answer_matching_prompt_text(tok):
    """An answer that repeats the prompt's text is located after the prompt, not inside it."""
    conv = [{"role": "user", "content": "Repeat: ok"}, {"role": "assistant", "content": "ok"}]
    s = tokenize_conversation(tok, conv, max_length=512)
    assert supervised_text(tok, s) == ["ok<|im_end|>"]


def test_truncation_and_drop(tok):
    full = tokenize_conversation(tok, CHAT, max_length=512)
    first = full.loss_mask.index(1)
    cut = tokenize_conversation(tok, CHAT, max_length=first + 3)
    assert cut.input_ids == full.input_ids[:first + 3] and sum(cut.loss_mask) == 3
    # One supervised token left: no anchor possible -> dropped.
    assert tokenize_conversation(tok, CHAT, max_length=first + 1) is None
    assert tokenize_conversation(tok, CHAT[:1] + [{"role": "assistant", "content": "A"}], max_length=512,
                                 supervise_end=False) is None


def test_supervise_end_off(tok):
    s = tokenize_conversation(tok, CHAT, max_length=512, supervise_end=False)
    assert supervised_text(tok, s) == ["yes, 2+2=4."]


def test_target_answer_ids_used_verbatim(tok):
    """The target's generated ids (here spelled one character at a time: valid, but not what
    re-encoding the text gives) are kept as they are; ids that spell another text are not."""
    spelled = [t for ch in CHAT[1]["content"] for t in encode(tok, ch)]
    canonical = tokenize_conversation(tok, CHAT, max_length=512)
    s = tokenize_conversation(tok, CHAT, max_length=512, answer_ids=spelled)
    p = prompt_ids(tok, CHAT[:1])
    assert s.input_ids[:len(p)] == p and s.input_ids[len(p):len(p) + len(spelled)] == spelled
    assert s.input_ids != canonical.input_ids and supervised_text(tok, s) == supervised_text(tok, canonical)
    assert sum(s.loss_mask) == len(spelled) + 1  # + the end-of-turn token
    other = encode(tok, "no.")
    assert tokenize_conversation(tok, CHAT, max_length=512, answer_ids=other) == canonical


def test_template_that_rewrites_answers(tok):
    t = copy.deepcopy(tok)
    t.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content | upper }}\n{% endfor %}"
    with pytest.raises(ChatTemplateError, match="assistant turn 1"):
        tokenize_conversation(t, CHAT, max_length=512)


def test_tokenize_file(tok, tmp_path):
    src = tmp_path / "regen.jsonl"
    lines = [json.dumps({"id": "a", "messages": CHAT, "finish_reason": "stop"}),
             json.dumps({"id": "b", "messages": CHAT[:1] + [{"role": "assistant", "content": "no"}], "finish_reason": "length"}),
             '{"id": "c", "messages": [',  # malformed, line 3
             json.dumps({"id": "d", "messages": CHAT[:1]}),  # no answer: dropped
             json.dumps({"id": "e", "messages": MULTI}),
             json.dumps({"id": "f", "messages": CHAT, "finish_reason": "stop",
                         "completion_ids": [t for ch in "yes, 2+2=4." for t in encode(tok, ch)] + [2]})]
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "tok.jsonl"
    (tmp_path / ".tok.jsonl.999999999.tmp").write_text("{")  # left by a killed run (no such process)
    stats = tokenize_file(src, tok, out, max_length=512)
    assert stats.written == 3 and stats.dropped_unsupervised == 2 and stats.conversations == 5 and stats.target_ids == 1
    assert len(stats.problems) == 1 and stats.problems[0].startswith(f"{src}:3:")
    samples = load_tokenized(out)
    assert [s.id for s in samples] == ["a", "e", "f"]
    assert samples[2].input_ids != samples[0].input_ids and len(samples[2].input_ids) > len(samples[0].input_ids)
    assert samples[0] == tokenize_conversation(tok, CHAT, max_length=512, id="a")
    assert stats.tokens == sum(len(s.input_ids) for s in samples)
    assert not list(tmp_path.glob(".*tmp"))
    out.write_text('{"id": "x", "input_ids": [1, 2], "loss_mask": [1]}\n')
    with pytest.raises(ValueError, match=f"{out}:1: input_ids has 2 entries"):
        load_tokenized(out)


def test_tokenize_file_refuses_to_write_nothing(tok, tmp_path):
    """A prompt file tokenised by mistake (no answers) fails here, naming the file, and leaves no
    output: an empty file would only fail later, in training."""
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(json.dumps({"id": str(i), "messages": CHAT[:1]}) for i in range(3)) + "\n")
    out = tmp_path / "tok.jsonl"
    with pytest.raises(ValueError, match=rf"{src}: none of its 3 conversations.*3 end without an assistant answer"):
        tokenize_file(src, tok, out, max_length=512)
    assert not out.exists() and not list(tmp_path.glob(".*tmp"))
