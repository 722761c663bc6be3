"""The one-kernel q/k/v heads (`kernels/heads.py`, Triton) equal `static.qkv` in PyTorch: the
queries in the attention's layout and the keys and values written into the cache at ragged slots,
for Qwen3's head norms, Gemma's (1 + w) norms and no head norms (Llama); and, without queries, the
drafter's keys and values as its own layers make them. On CUDA in bf16,
elsewhere through Triton's interpreter (fp32 and fp16) in a subprocess, since the interpreter is
chosen when the kernels are defined."""

from __future__ import annotations

import pytest
import torch

from conftest import in_triton_interpreter
from dflashkit.kernels import heads

pytestmark = pytest.mark.skipif(heads.triton is None, reason="Triton is not installed")

CASES = [  # (rows, tokens, heads, kv heads, head dim, head norms, offset)
    (1, 16, 4, 2, 128, True, False),  # Qwen3: a DFlash block
    (2, 5, 6, 2, 64, True, True),  # Gemma 3: norms of (1 + w)
    (3, 1, 4, 4, 64, False, False),  # Llama: no head norms, an AR step of a ragged batch
]


def check(dtype: torch.dtype, device: str) -> None:
    from dflashkit.decode.cache import LayerKV
    from dflashkit.decode.static import LayerWeights, qkv, qkv_fused

    g = torch.Generator().manual_seed(0)
    for b, t, H, KV, d, norms, offset in CASES:
        hidden, cap = 96, 40

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g).to(device, dtype)

        qn, kn = (rand(d) if norms else None for _ in range(2))
        w = LayerWeights(ln1=rand(hidden), q=None, qb=None, k=None, kb=None, v=None, vb=None, qn=qn, kn=kn,
                         o=rand(hidden, H * d), ob=None, ln2=rand(hidden), gate=None, gb=None, up=None, ub=None,
                         down=None, db=None, qkv=rand((H + 2 * KV) * d, hidden) / hidden ** 0.5, offset=offset)
        h = rand(b, t, hidden)
        angles = torch.rand(b, t, d // 2, generator=g) * 6
        cos, sin = (f(torch.cat([angles, angles], -1)).to(device, dtype)[:, None] for f in (torch.cos, torch.sin))
        lengths = torch.randint(0, cap - t, (b,), generator=g)
        slots = (lengths[:, None] + torch.arange(t)).to(device)
        caches = []
        for make in (qkv, qkv_fused):
            kv = LayerKV(rand(b, KV, cap, d), rand(b, KV, cap, d))  # garbage around the slots must stay
            before = (kv.k.clone(), kv.v.clone())
            q, gate = make(h, w, 1e-6, cos, sin, H, KV, d, kv, slots)
            assert gate is None
            caches.append((q, kv, before))
        (q_ref, kv_ref, _), (q, kv, before) = caches
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(q, q_ref, rtol=tol, atol=tol)
        written = torch.zeros(b, cap, dtype=torch.bool)
        written[torch.arange(b)[:, None], slots.cpu()] = True
        for new, ref, old in ((kv.k, kv_ref.k, before[0]), (kv.v, kv_ref.v, before[1])):
            new, ref, old = (x.transpose(1, 2).cpu() for x in (new, ref, old))  # [b, cap, KV, d]
            torch.testing.assert_close(new[written], ref[written], rtol=tol, atol=tol)
            assert torch.equal(new[~written], old[~written])  # nothing else touched
        # the last token alone (an AR step) gets bit for bit on CUDA what it gets inside the block
        kv_alone = LayerKV(kv.k.clone(), kv.v.clone())
        alone = qkv_fused(h[:, -1:], w, 1e-6, cos[:, :, -1:], sin[:, :, -1:], H, KV, d, kv_alone, slots[:, -1:])[0]
        within = q.view(b, KV, H // KV, t, d)[:, :, :, -1:].reshape(alone.shape)
        assert torch.equal(alone, within) if q.is_cuda else torch.allclose(alone, within, rtol=tol, atol=tol)
        if norms:  # the norms matter: the reference without them differs
            plain = qkv(h, w._replace(qn=None, kn=None), 1e-6, cos, sin, H, KV, d, kv_ref, slots)[0]
            assert (plain - q_ref).abs().max() > 100 * tol


def check_keys_values(dtype: torch.dtype, device: str) -> None:
    """Without queries (a drafter's new context and block, `drafter.Attention.store`): the keys and
    values that the drafter's own `_kv` makes, written where `KVCache.store` writes them, into one
    layer of a cache of two; nothing else touched. On CUDA, `Attention.store` takes this path; under
    torch.compile it writes each layer as eager does."""
    from dflashkit.decode.cache import KVCache
    from dflashkit.kernels.packed import fused_linear
    from dflashkit.drafter import Attention, DrafterConfig, rope_cos_sin

    g = torch.Generator().manual_seed(1)
    b, t, cap, KV, d = 3, 9, 40, 2, 64
    cfg = DrafterConfig(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=KV, head_dim=d, vocab_size=100, num_target_layers=2,
                        target_layer_ids=[0, 1], mask_token_id=1)
    attn = Attention(cfg)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.ndim > 1 else 1))
    attn = attn.to(device, dtype)
    attn.kv_weight = torch.cat([attn.k_proj.weight, attn.v_proj.weight]).detach()
    x = torch.randn(b, t, cfg.hidden_size, generator=g).to(device, dtype)
    slots = (torch.randint(0, cap - t, (b,), generator=g)[:, None] + torch.arange(t)).to(device)
    cos, sin = rope_cos_sin(slots, d, cfg.rope_theta, dtype)

    def fresh() -> KVCache:
        cache = KVCache(2)
        cache.start(b, x.device)
        cache.reserve(cap)
        cache.allocate(x.new_empty(b, KV, 0, d))
        return cache

    caches = []
    for fused in (False, True):
        cache = fresh()
        if not caches:  # (the capacity allocated is aligned past `cap`)
            garbage = [torch.randn(cache.k.shape, generator=g).to(device, dtype) for _ in range(2)]
        cache.k.copy_(garbage[0])
        cache.v.copy_(garbage[1])
        if fused:
            cache.store_heads(1, fused_linear(x, attn.kv_weight, attn.k_proj), attn.k_norm.weight, attn.k_norm.eps,
                              cos, sin, slots)
        else:
            cache.store(1, *attn._kv(x, cos, sin, fused=True), slots)
        caches.append(cache)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    written = torch.zeros(2, b, cache.capacity, dtype=torch.bool)
    written[1, torch.arange(b)[:, None], slots.cpu()] = True
    for new, ref, old in ((caches[1].k, caches[0].k, garbage[0]), (caches[1].v, caches[0].v, garbage[1])):
        new, ref, old = (z.transpose(2, 3).cpu() for z in (new, ref, old))  # [2, b, cap, KV, d]
        torch.testing.assert_close(new[written], ref[written], rtol=tol, atol=tol)
        assert torch.equal(new[~written], old[~written])
    if x.is_cuda:
        taken = []
        caches[0].store_heads = lambda *a: taken.append(a)
        attn.store(caches[0], 1, x, cos, sin, slots)
        assert taken
    if dtype == torch.float16:
        return
    # Compiled, as a draft step is: Inductor over the layers of one buffer once sent an opaque op's
    # writes for every layer into the first layer's slots. Each layer lands where eager puts it.
    available = heads.available
    heads.available = lambda *a: True  # the CUDA path (elsewhere through the interpreter)
    try:
        def both(cache: KVCache) -> None:
            for layer in (0, 1):
                attn.store(cache, layer, x + layer, cos, sin, slots)  # (a scale would leave normed keys alike)
        eager, compiled = fresh(), fresh()
        both(eager)
        torch.compile(both, dynamic=True, fullgraph=True)(compiled)  # (the op traced, not a graph break)
    finally:
        heads.available = available
    torch.testing.assert_close(compiled.k, eager.k, rtol=tol, atol=tol)
    torch.testing.assert_close(compiled.v, eager.v, rtol=tol, atol=tol)
    assert not torch.allclose(compiled.k[0], compiled.k[1], rtol=tol, atol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_heads_kernel_on_cuda():
    check(torch.bfloat16, "cuda")
    check_keys_values(torch.bfloat16, "cuda")


def test_heads_kernel_in_triton_interpreter():
    code = ("import torch, test_heads as t\nt.check(torch.float32, 'cpu')\nt.check(torch.float16, 'cpu')\n"
            "t.check_keys_values(torch.float32, 'cpu')\nt.check_keys_values(torch.float16, 'cpu')\n")
    in_triton_interpreter(code)


def check_drafter_store() -> None:
    """The bundled drafter on the SmolLM2 testbed, its draft compiled as on CUDA (`compile_drafter`,
    fused [k; v] weights) with keys and values stored by the heads kernel (`drafter.Attention.store`;
    here through Triton's interpreter, the attention on SDPA off CUDA), accepts what the PyTorch
    path accepts, round by round, and decodes the same tokens."""
    import types

    from dflashkit import drafter as drafter_mod
    from dflashkit.checkpoint import load_drafter
    from dflashkit.data.prompts import load_prompts
    from dflashkit.decode.loop import generate_batch
    from dflashkit.decode.static import static_engine
    from dflashkit.demo import bundled_drafter_dir
    from dflashkit.evaluate import eval_prompts
    from dflashkit.target import load_target

    target = load_target()
    drafter = load_drafter(bundled_drafter_dir(), target, device=target.device, dtype=target.dtype)
    prompts = [p.ids for p in eval_prompts(load_prompts("humaneval", limit=2), target.tokenizer)]
    kw = dict(max_new_tokens=24, method="dflash")
    ref = generate_batch(static_engine(target, drafter, fuse=True), prompts, **kw)
    drafter_mod.heads = types.SimpleNamespace(available=lambda *a: True)  # the CUDA path, for the drafter alone
    engine = static_engine(target, drafter, compile_drafter=True, fuse=True)  # (fused [k; v] weights, as on CUDA)
    got = generate_batch(engine, prompts, **kw)
    assert not engine.unchecked_draft  # the compiled draft was compared with an eager one
    assert [g.tokens for g in got] == [r.tokens for r in ref]
    assert [g.accept_lengths for g in got] == [r.accept_lengths for r in ref]
    assert max(max(r.accept_lengths) for r in ref) > 2  # drafts that the target accepts: the comparison means something


@pytest.mark.slow
def test_drafter_store_kernel_drafts_as_pytorch_in_triton_interpreter(smollm2):
    code = "import test_heads as t\nt.check_drafter_store()\n"  # (the fixture has cached the testbed)
    in_triton_interpreter(code, timeout=900)
