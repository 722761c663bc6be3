"""`bench.confidence` (what `benchmarks/suite_confidence.py` runs) turns a round's accepted count
at each answer position into hits and misses of the drafted tokens it reached, each with the
target's probability of that token: the accepted tokens are hits, the first rejected one (if the
block and the answer go on) is the miss that ends the round."""

from __future__ import annotations

import torch

from conftest import make_tiny_drafter
from dflashkit.bench import confidence


def test_hits_and_misses_are_the_tokens_each_round_reached(tiny_target, monkeypatch):
    drafter = make_tiny_drafter(tiny_target)  # block 8: at most 7 drafted tokens a round
    prompt, answer = torch.tensor([5, 9, 14, 3]), [7, 21, 30, 11, 8, 40, 12, 6, 19, 25, 33, 17]
    n = len(prompt)
    accepted = {n: 2, n + 1: 0, n + 2: 7, n + 9: 1, n + 10: 1}  # position -> accepted draft tokens
    monkeypatch.setattr(confidence, "offline_accepted", lambda *a, **k: ({"dflash": accepted}, []))
    probs, drafted = confidence.drafted_tokens(tiny_target, drafter, prompt, answer)

    ids = torch.cat([prompt, torch.tensor(answer)])
    with torch.no_grad():
        own = tiny_target.model(ids[None]).logits[0].float().softmax(-1)
    expect = [own[n - 1 + i, t].item() for i, t in enumerate(answer)]  # P(answer token i | everything before)
    assert torch.allclose(torch.tensor(probs), torch.tensor(expect), atol=1e-6)

    q = lambda pos: probs[pos - n]  # the target's probability of the token at position pos
    want = [(q(n + 1), True), (q(n + 2), True), (q(n + 3), False),  # 2 accepted, the third missed
            (q(n + 2), False),                                      # none accepted: the first token missed
            *[(q(n + 2 + k), True) for k in range(1, 8)],           # the whole block accepted: no miss
            (q(n + 10), True), (q(n + 11), False),                  # 1 accepted, the second missed
            (q(n + 11), True)]                                      # the answer's last token: nothing after it
    assert drafted == want
