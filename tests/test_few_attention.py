"""The fused few-query attention (`few_attention.attend`, Triton) equals SDPA under a tree's
visibility: on CUDA in bf16, elsewhere through Triton's interpreter (fp32, and fp16 on the
DFlash shape: the interpreter multiplies bf16 wrongly) in a subprocess, since the interpreter is
chosen when the kernels are defined."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import in_triton_interpreter
from dflashkit import few_attention

pytestmark = pytest.mark.skipif(few_attention.triton is None, reason="Triton is not installed")

CASES = [  # (rows, kv heads, g, queries, slots, head dim): an AR step, a DFlash block, a DDTree-64 tree (>1 query tile)
    (1, 2, 2, 1, 300, 64),
    (1, 2, 4, 16, 768, 128),
    (2, 2, 2, 65, 256, 64),
    (1, 1, 4, 16, 4000, 64),  # long: spans of 256 keys
]


def check(dtype: torch.dtype, device: str) -> None:
    from dflashkit.decode.static import attend, folded_mask
    from dflashkit.decode.tree import visibility

    g = torch.Generator().manual_seed(0)
    spread, short = few_attention.FILL, few_attention.DIRECT_KEYS
    for b, kv, grp, t, n, d in CASES:
        lengths = torch.randint(n // 3, n // 2, (b,), generator=g)  # a long invisible tail: the mask matters
        depths = torch.arange(t).repeat(b, 1)
        ancestors = torch.tril(torch.rand(b, t, t, generator=g) < 0.5) | torch.eye(t, dtype=torch.bool)
        mask = folded_mask(visibility(lengths, depths, ancestors, n, None), grp, dtype).to(device)
        q = torch.randn(b, kv, grp * t, d, generator=g).to(device, dtype)
        k, v = (torch.randn(b, kv, n, d, generator=g).to(device, dtype) for _ in range(2))
        want = attend(q.float(), k.float(), v.float(), mask.float(), d ** -0.5)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        got = few_attention.attend(q, k, v, mask, d ** -0.5)
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
        # each token's heads in order, as the output projection reads them: from spans of keys and a
        # combine (short caches too, with `DIRECT_KEYS` 0), and from one span written directly
        by_token = want.reshape(b, kv, grp, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, kv * grp * d)
        for fill, direct in ((spread, 0), (1, short)):
            few_attention.FILL, few_attention.DIRECT_KEYS = fill, direct
            tokens = few_attention.attend(q, k, v, mask, d ** -0.5, t)
            torch.testing.assert_close(tokens.float(), by_token, rtol=tol, atol=tol)
        few_attention.FILL, few_attention.DIRECT_KEYS = spread, short
        # a token's queries alone (an AR step) get bit for bit on CUDA what they get inside the block
        # (the same tile shapes and spans): AR and a verification then part in bf16 only where other
        # kernels round apart (the interpreter's numpy products may group a row's sums by position)
        last = slice(t - 1, None, t)  # the last token's g queries in the folded layout
        alone = few_attention.attend(q[:, :, last], k, v, mask[:, :, last], d ** -0.5)
        within = got[:, :, last]
        assert torch.equal(alone, within) if q.is_cuda else torch.allclose(alone, within, rtol=tol, atol=tol)
        # the mask matters: without it the output differs (by more than the tolerance, many times over)
        unmasked = few_attention.attend(q, k, v, torch.zeros_like(mask), d ** -0.5).float()
        assert (unmasked - want).abs().max() > 100 * 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_few_attention_on_cuda():
    check(torch.bfloat16, "cuda")


def test_fused_few_attention_in_triton_interpreter():
    code = ("import torch, test_few_attention as t\n"
            "t.check(torch.float32, 'cpu')\nt.CASES = t.CASES[1:2]\nt.check(torch.float16, 'cpu')\n"
            "t.few_attention.use = lambda *a: True\nt.check_drafter(torch.float32, 'cpu')\n")
    in_triton_interpreter(code)


@contextlib.contextmanager
def fused_calls():
    """The calls made to `few_attention.attend` inside the block, as a list that grows."""
    calls, fused = [], few_attention.attend
    few_attention.attend = lambda *a, **kw: calls.append(1) or fused(*a, **kw)
    try:
        yield calls
    finally:
        few_attention.attend = fused


def check_drafter(dtype: torch.dtype, device: str) -> None:
    """The drafter's layout (`drafter.attend_heads`: q [b, h, t, d], the g query heads of a KV head
    folded into the query axis, the mask repeated for each) through the fused kernel, at several
    rows (a batched draft) over its context and block, equals SDPA, each token's heads written
    together; through `drafter.attend` a draft takes that path, training (no `decoding`: it needs a
    backward) keeps SDPA."""
    import torch.nn.functional as F

    from dflashkit import drafter

    g = torch.Generator().manual_seed(0)
    b, h, kv, t, n, d = 4, 9, 3, 8, 300, 64
    q = torch.randn(b, h, t, d, generator=g).to(device, dtype)
    k, v = (torch.randn(b, kv, n, d, generator=g).to(device, dtype) for _ in range(2))
    lengths = torch.randint(n // 3, n // 2, (b,), generator=g)
    # [b, 1, t, n]: each query sees a different span (a fold that mixed queries up would show)
    seen = torch.arange(n) < (lengths[:, None] + 1 + torch.arange(t))[:, None, :, None]
    mask = drafter.additive(seen, dtype).to(device)
    with fused_calls() as calls:
        got = drafter.attend_heads(q, k, v, mask)
        assert calls, "several rows did not attend through few_attention"
        assert got.transpose(1, 2).is_contiguous()  # each token's heads together: no copy before o_proj
        if q.is_cuda:
            calls.clear()
            torch.testing.assert_close(drafter.attend(q, k, v, mask, True, decoding=True), got, rtol=0, atol=0)
            assert calls
            calls.clear()
            drafter.attend(q, k, v, mask, True)
            assert not calls
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float(), enable_gqa=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_drafter_rows_attend_through_the_fused_kernel_on_cuda():
    check_drafter(torch.bfloat16, "cuda")
