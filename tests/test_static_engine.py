"""The static engine's fused weights: one buffer, no second copy, same outputs."""

from __future__ import annotations

import torch

from conftest import make_tiny_drafter, make_tiny_target
from dflashkit.decode.loop import generate
from dflashkit.decode.static import static_engine


def test_fused_weights_are_views_not_copies():
    target = make_tiny_target(num_layers=6)
    drafter = make_tiny_drafter(target)
    torch.manual_seed(0)
    ids = torch.randint(3, 120, (1, 12))
    before = [p.detach().clone() for p in target.model.parameters()]
    ref = generate(static_engine(target, drafter, fuse=False), ids, max_new_tokens=20, method="dflash").tokens

    eng = static_engine(target, drafter, fuse=True)
    attn, mlp = target.layers[0].self_attn, target.layers[0].mlp
    qkv, gate_up = eng.run.tw[0].qkv, eng.run.tw[0].gate_up
    # The modules now read from the fused buffers: no second copy of those weights stays alive.
    assert attn.q_proj.weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()
    assert torch.equal(qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert all(torch.equal(a, b) for a, b in zip(before, target.model.parameters()))  # values untouched

    again = static_engine(target, drafter, fuse=True)  # a second engine reuses the buffer
    assert again.run.tw[0].qkv.data_ptr() == qkv.data_ptr() and again.run.tw[0].gate_up.data_ptr() == gate_up.data_ptr()
    for e in (eng, again):
        assert generate(e, ids, max_new_tokens=20, method="dflash").tokens == ref
    # The Transformers forward of the re-pointed modules is unchanged too.
    assert target.model.generate(ids, max_new_tokens=5, do_sample=False)[0, 12:].tolist() == ref[:5]
