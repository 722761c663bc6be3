"""The static engine's fused weights: one buffer, no second copy, same outputs."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_drafter, make_tiny_target, read_late
from dflashkit.decode.accept import Steps
from dflashkit.decode.loop import generate
from dflashkit.decode.static import attend, folded_mask, static_engine
from dflashkit.decode.tree import visibility
from dflashkit.drafter import additive, attend_few, attend_heads
from dflashkit.kernels.packed import PackedLinear


def test_fused_weights_are_views_not_copies():
    target = make_tiny_target(num_layers=6)
    drafter = make_tiny_drafter(target)
    torch.manual_seed(0)
    ids = torch.randint(3, 120, (1, 12))
    before = [p.detach().clone() for p in target.model.parameters()]
    ref = generate(static_engine(target, drafter, fuse=False), ids, max_new_tokens=20, method="dflash").tokens

    eng = static_engine(target, drafter, fuse=True, pack=False)  # packed weights are copies in oneDNN's layout
    attn, mlp = target.layers[0].self_attn, target.layers[0].mlp
    qkv, gate_up = eng.run.tw[0].qkv, eng.run.tw[0].gate_up
    # The modules now read from the fused buffers: no second copy of those weights stays alive.
    assert attn.q_proj.weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()
    assert torch.equal(qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert all(torch.equal(a, b) for a, b in zip(before, target.model.parameters()))  # values untouched

    again = static_engine(target, drafter, fuse=True, pack=False)  # a second engine reuses the buffer
    assert again.run.tw[0].qkv.data_ptr() == qkv.data_ptr() and again.run.tw[0].gate_up.data_ptr() == gate_up.data_ptr()
    for e in (eng, again):
        assert generate(e, ids, max_new_tokens=20, method="dflash").tokens == ref
    # The Transformers forward of the re-pointed modules is unchanged too.
    assert target.model.generate(ids, max_new_tokens=5, do_sample=False)[0, 12:].tolist() == ref[:5]


def test_weights_stored_by_columns_are_views_and_decode_the_same(monkeypatch):
    """Where the output, MLP and LM-head weights are stored [in, out] (on CUDA; forced here): the
    target's modules read transposed views of one buffer each (no copy left, values untouched, a
    second engine reuses them), the engine's copy of the drafter is laid out so too, with its k/v
    and gate/up fused (the caller's drafter is left as it was), and greedy AR, DFlash and DDTree,
    alone and ragged, equal autoregressive decoding before the change, and the target's own
    `generate` is unchanged."""
    from dflashkit.decode import static
    from dflashkit.decode.loop import generate_batch

    target = make_tiny_target(tie=False)
    drafter = make_tiny_drafter(target, seed=2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 120, (n,), generator=g) for n in (12, 30, 7)]
    hf = [target.model.generate(p[None], max_new_tokens=24, do_sample=False)[0, len(p):].tolist() for p in prompts]
    want = [x.tokens for x in generate_batch(static_engine(target, None, pack=False), prompts, max_new_tokens=24, method="ar")]
    before = {n: p.detach().clone() for n, p in [*target.model.named_parameters(), *drafter.named_parameters()]}
    monkeypatch.setattr(static, "COLUMN_WEIGHTS", True)
    eng = static_engine(target, drafter, fuse=True, pack=False)
    layer, head = target.layers[0], target.model.get_output_embeddings()
    mlp, dlayer = layer.mlp, eng.drafter.layers[0]
    gate_up, dgate_up = eng.run.tw[0].gate_up, dlayer.mlp.gate_up
    assert gate_up.stride() == (1, gate_up.shape[0]) and mlp.up_proj.weight.data_ptr() == gate_up[64 * 2:].data_ptr()
    assert dgate_up.stride() == (1, dgate_up.shape[0]) and dlayer.mlp.up_proj.weight.data_ptr() == dgate_up[dgate_up.shape[0] // 2:].data_ptr()
    for w in (layer.self_attn.o_proj.weight, mlp.down_proj.weight, head.weight, dlayer.self_attn.o_proj.weight,
              dlayer.mlp.down_proj.weight):
        assert w.stride() == (1, w.shape[0]) and w.t().is_contiguous()
    kv = dlayer.self_attn.kv_weight  # [k; v] by rows, as the target's q/k/v
    assert kv.is_contiguous() and dlayer.self_attn.v_proj.weight.data_ptr() == kv[kv.shape[0] // 2:].data_ptr()
    assert layer.self_attn.q_proj.weight.is_contiguous()  # q/k/v stay by rows
    assert eng.drafter is not drafter and all(p.is_contiguous() for p in drafter.parameters())
    assert drafter.layers[0].self_attn.kv_weight is None and drafter.layers[0].mlp.gate_up is None
    after = dict([*target.model.named_parameters(), *drafter.named_parameters()])
    assert all(torch.equal(before[n], after[n]) for n in before)
    again = static_engine(target, drafter, fuse=True, pack=False)
    assert again.run.tw[0].gate_up.data_ptr() == gate_up.data_ptr() and again.run.tw[0].o.data_ptr() == eng.run.tw[0].o.data_ptr()
    for method, budget in [("ar", None), ("dflash", None), ("ddtree", 12)]:
        assert [x.tokens for x in generate_batch(eng, prompts, max_new_tokens=24, method=method, budget=budget)] == want
    assert generate(again, prompts[0], max_new_tokens=24, method="dflash").tokens == want[0]
    assert [target.model.generate(p[None], max_new_tokens=24, do_sample=False)[0, len(p):].tolist() for p in prompts] == hf


def _counting_engine(monkeypatch, captures: dict[str, int]):
    """A tiny target's graph engine (fixed rows, as `static_engine` on CUDA) on CPU, `Graphs`
    replaced by a counter of the signatures it would capture (and of buffer moves), run eagerly."""
    import dflashkit.decode.static as st

    class Counting:
        def __init__(self, fn, buffers=lambda: None, preserve=list, shared=False):
            self.fn, self.buffers, self.keys, self.where, self.calls = fn, buffers, set(), None, 0
            self.name = getattr(fn, "__name__", "commit") + (" (shared pool)" if shared else "")

        def __call__(self, *args):
            self.calls += 1
            if self.buffers() != self.where:
                self.keys, self.where = set(), self.buffers()
            key = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
            if key not in self.keys:
                self.keys.add(key)
                captures[self.name] = captures.get(self.name, 0) + 1
            return self.fn(*args)

    monkeypatch.setattr(st, "Graphs", Counting)
    torch.manual_seed(0)
    target = make_tiny_target()
    drafter = make_tiny_drafter(target)
    engine = st.Engine(target, drafter, st.StaticRunner(target, list(drafter.config.target_layer_ids), cuda_graphs=True))
    engine.slot_bucket, engine.fixed_rows = st.SLOT_BUCKET, True  # as `static_engine` sets them on CUDA
    engine.draft_step = Counting(engine._draft_step, lambda: engine.dcache.k.data_ptr())
    engine.long_draft_step = Counting(engine._draft_step, lambda: engine.dcache.k.data_ptr(), shared=True)
    engine.accept_steps = st._accept_graphs(Steps())  # (Graphs is `Counting` here)
    return engine


def test_joins_capture_no_new_graphs(monkeypatch):
    """Continuous batching on the graph engine: requests joining a running batch reuse the
    target's and the drafter's captured graphs (a re-capture per join would stall every row)."""
    from dflashkit.decode.loop import Request, decode_stream

    captures: dict[str, int] = {}
    engine = _counting_engine(monkeypatch, captures)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (int(n),), generator=g) for n in torch.randint(5, 60, (48,), generator=g)]
    rows, queue, joins = 8, iter(range(8, 48)), []

    def admit(running: int) -> list[Request]:
        new = [i for _, i in zip(range(rows - running), queue)]
        joins.extend([running] if new and running else [])
        return [Request(prompts[i], 24) for i in new]

    out = {}
    for step in decode_stream(engine, prompts[:rows], method="dflash", max_new_tokens=24, admit=admit):
        out.update((i, g.tokens) for i, _, g in step if g.finish_reason)
    assert len(out) == 48 and len(joins) >= 5
    assert captures == {"_step": 1, "_draft_step": 1}, captures


def test_joins_replay_staging_graphs_captured_before_serving(monkeypatch):
    """Requests joining a running graph engine are prefilled by staging engines (`Engine.join`:
    groups of a power of two of them, lengths padded to geometric buckets) whose graphs
    `warm_joins` captures before serving: the joins then capture nothing, a join too large for one
    staging pass is split into groups that fit (none runs eagerly on a fresh engine), and every
    answer equals decoding its prompt alone (so the padding tokens never reach a real row). Rounds are read a round late, as on a GPU: requests join while the
    round after a row's end still runs."""
    from dflashkit.decode.loop import Request, decode_stream

    read_late(monkeypatch)
    captures: dict[str, int] = {}
    engine = _counting_engine(monkeypatch, captures)
    engine.join_pass = 512  # (smaller than on a GPU: fewer warm-up passes on the CPU)
    g = torch.Generator().manual_seed(4)
    # short prompts, and a long one now and then (a group with it is too large for a staging pass)
    lengths = [200 + i if i % 7 == 3 else 5 + (37 * i) % 56 for i in range(40)]
    prompts = [torch.randint(3, 120, (n,), generator=g) for n in lengths]
    rows, queue, joins = 8, iter(range(8, 40)), []

    def admit(running: int) -> list[Request]:  # groups of 1 to 8 (8 x 256 tokens > 512: split)
        new = [i for _, i in zip(range(rows - running), queue)]
        joins.extend([len(new)] if new and running else [])
        return [Request(prompts[i], limits[i]) for i in new]

    limits = [6 + 5 * (i % 4) for i in range(40)]  # rows end at different rounds: groups of every size
    engine.prefill([prompts[0]] * rows, capacity=512)  # the batch's caches, as a server's warm-up leaves them
    engine.warm_joins(rows)
    shapes = {m: set(stage.run.prefills.keys) for m, stage in engine.stagings.items()}
    assert sorted(shapes) == [1, 2, 4, 8] and len(shapes[1]) == 4 and len(shapes[8]) == 1, shapes
    out = {}
    for step in decode_stream(engine, prompts[:rows], method="dflash", max_new_tokens=limits[:rows], admit=admit):
        out.update((i, g.tokens) for i, _, g in step if g.finish_reason)
    assert len(out) == 40 and len(joins) >= 5 and any(n & (n - 1) for n in joins), joins  # (some counts split)
    assert engine.eager_joins == 0
    assert {m: set(stage.run.prefills.keys) for m, stage in engine.stagings.items()} == shapes
    assert sum(stage.run.prefills.calls for stage in engine.stagings.values()) > sum(map(len, shapes.values()))
    alone = static_engine(engine.target, engine.drafter, cuda_graphs=False)
    assert [out[i] for i in range(40)] == [generate(alone, p, max_new_tokens=n).tokens for p, n in zip(prompts, limits)]


def test_small_prefills_and_first_drafts_replay_one_graph_per_length_bucket(monkeypatch):
    """Prompts of 5 to 60 tokens, one after another on one graph engine: each prefill and each
    prompt-long first draft is padded to the same length bucket, so one graph of each serves them
    all (eagerly, a 200-token prefill is a thousand launches), and every answer is the plain
    engine's."""
    import dflashkit.decode.static as st

    captures: dict[str, int] = {}
    engine = _counting_engine(monkeypatch, captures)
    engine.small_pass = st.SMALL_PASS_TOKENS
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 120, (n,), generator=g) for n in (60, 5, 33, 47, 12, 59)]  # longest first: no growth
    plain = static_engine(engine.target, engine.drafter, fuse=False)
    for p in prompts:
        assert generate(engine, p, max_new_tokens=12).tokens == generate(plain, p, max_new_tokens=12).tokens
    # (the first prompt allocates the caches, eagerly); verification, prefill, draft, first draft
    assert captures == {"_step": 1, "_step (shared pool)": 1, "_draft_step": 1, "_draft_step (shared pool)": 1}, captures


def test_evaluation_warm_up_leaves_no_capture_to_the_timed_runs(monkeypatch):
    """`evaluate.warm_up` on a graph engine (the first prompt in full, then two tokens of one prompt
    per length bucket): afterwards decoding every prompt, autoregressively and with DFlash,
    captures no graph, so no method's tokens/s in an evaluation pays for a capture."""
    import dflashkit.decode.static as st
    from dflashkit.evaluate import warm_up

    captures: dict[str, int] = {}
    engine = _counting_engine(monkeypatch, captures)
    engine.small_pass = st.SMALL_PASS_TOKENS
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 120, (1, n), generator=g) for n in (150, 10, 70, 100, 130, 40)]  # buckets 192, 64, 128
    warm_up([engine, engine], [("dflash", "dflash", None, "match")], prompts, dict(max_new_tokens=12))
    warm = dict(captures)
    assert warm["_step (shared pool)"] == 3 and warm["_draft_step (shared pool)"] == 3, warm  # one per bucket
    for p in prompts:
        for method in ("ar", "dflash"):
            generate(engine, p, max_new_tokens=12, method=method)
    assert captures == warm


def test_a_stream_that_starts_small_keeps_one_batch_size(monkeypatch):
    """A server's stream starts with whoever is queued (often one request) and the rest join one
    by one: with `rows` the batch holds all its rows from the start (idle placeholders), so one
    set of graphs serves the whole stream, and every answer equals decoding its prompt alone."""
    from dflashkit.decode.loop import Request, decode_stream

    captures: dict[str, int] = {}
    engine = _counting_engine(monkeypatch, captures)
    g = torch.Generator().manual_seed(1)
    # Longest first: the first request's room suffices for all, so the caches never grow (a
    # growth moves the buffers, which re-captures the graphs once per doubling).
    lengths = sorted(torch.randint(5, 40, (12,), generator=g).tolist(), reverse=True)
    prompts = [torch.randint(3, 120, (n,), generator=g) for n in lengths]
    queue = iter(range(1, len(prompts)))

    def admit(running: int) -> list[Request]:  # one newcomer per round while a row is free
        return [Request(prompts[i], 16) for _, i in zip(range(min(1, 6 - running)), queue)]

    out = {}
    for step in decode_stream(engine, prompts[:1], method="dflash", max_new_tokens=16, admit=admit, rows=6):
        out.update((i, g.tokens) for i, _, g in step if g.finish_reason)
        assert engine.batch == 6
    assert captures == {"_step": 1, "_draft_step": 1}, captures
    alone = static_engine(engine.target, engine.drafter, cuda_graphs=False)
    assert [out[i] for i in range(len(prompts))] == [generate(alone, p, max_new_tokens=16, method="dflash").tokens
                                                     for p in prompts]


def test_passes_outside_graphs_leave_cudnn_attention_out(monkeypatch):
    """cuDNN's attention builds a plan per new shape (a join cost ~90 ms of them on an H200): every
    engine pass runs SDPA without it, graph captures (`attention_backends(graph=True)`) with it,
    and the caller's setting comes back afterwards."""
    from dflashkit.decode.engine import Engine, attention_backends

    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    target = make_tiny_target()
    drafter = make_tiny_drafter(target)
    ids = torch.randint(3, 120, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.backends.cuda.cudnn_sdp_enabled()
    for engine in (static_engine(target, drafter), Engine(target, drafter)):
        seen.clear()
        generate(engine, ids, max_new_tokens=12, method="dflash")
        assert len(seen) > 10 and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with attention_backends(graph=True):
        assert torch.backends.cuda.cudnn_sdp_enabled()


def test_compiled_engine_equals_autoregressive():
    """The layer functions and the drafter's step under torch.compile (what `make_engine('auto')`
    builds on CUDA, here without graphs): greedy DFlash and DDTree equal plain AR, alone and batched."""
    from dflashkit.decode.loop import generate_batch

    target = make_tiny_target()
    # One layer: Dynamo traces the drafter's step layer by layer, most of this test's time. Seed 2:
    # DDTree accepts paths of several tokens in two rows (commits of accepted paths run compiled too).
    drafter = make_tiny_drafter(target, seed=2, num_layers=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 120, (n,), generator=g) for n in (12, 30, 7, 50)]
    ref = [x.tokens for x in generate_batch(static_engine(target, None), prompts, method="ar", max_new_tokens=16)]
    engine = static_engine(target, drafter, compile=True, compile_drafter=True)
    for method, budget in [("dflash", None), ("ddtree", 12)]:
        assert generate(engine, prompts[1], max_new_tokens=16, method=method, budget=budget).tokens == ref[1]
        outs = generate_batch(engine, prompts, max_new_tokens=16, method=method, budget=budget)
        assert [o.tokens for o in outs] == ref, method
        assert method != "ddtree" or sum(max(o.accept_lengths) > 1 for o in outs) == 2


def test_a_compiled_draft_step_that_disagrees_with_the_eager_one_fails_loudly():
    """The first compiled draft is compared with the same step run eagerly (`Engine._checked_draft`):
    a compiled step that writes a layer's keys into the wrong slots leaves decoding lossless and
    only acceptance low, so it must fail with a readable error instead (a real one passes the
    same check in `test_compiled_engine_equals_autoregressive`)."""
    target = make_tiny_target()
    drafter = make_tiny_drafter(target, num_layers=2)
    engine = static_engine(target, drafter, cuda_graphs=False, pack=False)

    def miscompiled(*args):  # the eager step, then layer 1's keys overwritten with layer 0's
        logits = engine._draft_logits(*args)
        engine.dcache.k[1] = engine.dcache.k[0]
        return logits

    engine.draft_logits, engine.unchecked_draft = miscompiled, True
    engine.prefill([torch.randint(3, 120, (30,))], capacity=200)
    engine.draft(torch.zeros(1, dtype=torch.long))  # the prompt's context, eagerly: the buffers now exist
    engine.pending, engine.pending_counts = torch.randn(1, 3, engine.pending.shape[2]), [3]
    with pytest.raises(RuntimeError, match=r"compiled draft step disagrees .*keys [0-9.]+.*--engine static"):
        engine.draft(torch.zeros(1, dtype=torch.long))


def test_compiled_draft_step_is_one_graph():
    """torch.compile(dynamic=True) of the drafter's step (as `make_engine('auto')` on CUDA) traces it
    whole, every layer in one graph: no graph break, no recompilation per layer. SDPA's
    `enable_gqa` once came from comparing two symbolic shapes, which broke each drafter layer in two
    and compiled it again for each layer index: 52 s before a server's first answer on an H200."""
    from torch._dynamo.utils import counters

    target = make_tiny_target()
    drafter = make_tiny_drafter(target, num_layers=3)
    engine = static_engine(target, drafter, cuda_graphs=False, pack=False)  # as on CUDA: no packed weights
    torch._dynamo.reset()
    counters.clear()
    engine.draft_logits = torch.compile(engine._draft_logits, dynamic=True, backend="eager")
    engine.prefill([torch.randint(3, 120, (30,))], capacity=128)
    width = engine.pending.shape[2]
    for accepted in (3, 5, 2, 0):  # after the prompt's context (run as it is), a round's accepted features
        engine.draft(torch.zeros(1, dtype=torch.long))
        engine.pending, engine.pending_counts = torch.randn(1, accepted, width), [accepted]
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_compiled_draft_step_writes_the_cache_in_place():
    """The drafter's compiled step (every layer in one graph over one shared cache buffer) writes
    each layer's new keys and values into their own slots, as the eager step does, and not into
    a new copy of the whole buffer that is then copied back: an `index_put_` into one layer's
    view did that, keys and values, every round (135 us of a 2.7 ms round at 32 rows on an
    H200, growing with the cache); an opaque op handed each layer's view wrote every layer into
    the first layer's slots (DFlash τ 2.3 -> 1.1 on the GPU)."""
    from torch._inductor.utils import run_and_get_code

    target = make_tiny_target()
    drafter = make_tiny_drafter(target, num_layers=2)
    engines = [static_engine(target, drafter, cuda_graphs=False, pack=False) for _ in range(2)]
    outs = []
    for compiled, engine in zip((False, True), engines):
        engine.prefill([torch.randint(3, 120, (30,), generator=torch.Generator().manual_seed(0))], capacity=200)
        engine.draft(torch.zeros(1, dtype=torch.long))  # the prompt's context: the buffers now exist
        new = torch.randn(1, 3, engine.pending.shape[2], generator=torch.Generator().manual_seed(1))
        engine.pending, engine.pending_counts = new, [3]
        if compiled:
            torch._dynamo.reset()
            engine.draft_logits = torch.compile(engine._draft_logits, dynamic=True)
            draft, code = run_and_get_code(engine.draft, torch.zeros(1, dtype=torch.long))
        else:
            draft = engine.draft(torch.zeros(1, dtype=torch.long))
        outs.append((draft.tokens, engine.dcache.k.clone(), engine.dcache.v.clone()))
    for eager, comp in zip(*outs):
        torch.testing.assert_close(comp, eager)
    whole = str(tuple(engines[1].dcache.k.shape)).replace(" ", "")  # [layers, b, kv heads, capacity, head dim]
    allocated = [line for line in "\n".join(code).splitlines() if "empty_strided" in line]
    assert allocated and not [line for line in allocated if whole in line.replace(" ", "")], whole


def test_first_drafts_of_every_length_bucket_share_one_compilation():
    """A prompt-long first draft padded to a length bucket (graph engines, `Engine.small_pass`)
    runs the compiled drafter's step, and the one compilation of the rounds serves it at every
    bucket (a compilation mid-serving stalls every row for seconds)."""
    from torch._dynamo.utils import counters

    import dflashkit.decode.static as st

    target = make_tiny_target()
    drafter = make_tiny_drafter(target, num_layers=2)
    engine = static_engine(target, drafter, cuda_graphs=False, pack=False)
    engine.small_pass = st.SMALL_PASS_TOKENS
    torch._dynamo.reset()
    counters.clear()
    engine.draft_logits = torch.compile(engine._draft_logits, dynamic=True, backend="eager")
    for n in (30, 100, 150, 60, 190):  # buckets 64, 128, 192, 64, 192; every span within 256 slots
        engine.prefill([torch.randint(3, 120, (n,))], capacity=240)
        engine.draft(torch.zeros(1, dtype=torch.long))  # the prompt's context (the first one eagerly: no buffers yet)
        engine.pending, engine.pending_counts = torch.randn(1, 3, engine.pending.shape[2]), [3]
        engine.draft(torch.zeros(1, dtype=torch.long))  # a round's
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_warm_up_captures_what_a_stream_needs(monkeypatch):
    """`serve` warms its generator up before listening: afterwards a stream of requests (of the
    same span bucket) captures no graph, so no request waits for compilation or capture."""
    from dflashkit.decode.loop import DecodingGenerator

    captures: dict[str, int] = {}
    engine = _counting_engine(monkeypatch, captures)
    gen = DecodingGenerator(engine, rows=4)
    gen.warm_up([5, 6, 7])
    # two spans of slots (the warm-up's second prompt crosses into the next; a cache that grows
    # for it captures again)
    assert captures["_step"] >= 2 and captures["_draft_step"] >= 2, captures
    warm = dict(captures)
    params = dict(max_new_tokens=20, temperature=0.0, top_p=1.0, seed=None, stop_ids=set())
    for step in gen.generate_batch([([9, 10, 11, 12], params), ([13, 14], params)]):
        pass
    assert captures == warm, captures


def test_warm_up_captures_the_rejection_rules_graphs(monkeypatch):
    """Under `--acceptance rejection` the warm-up also runs sampled rounds, with top-p and
    without: the rule's draws and checks are graphs of their own (`static._accept_graphs`), and a
    sampled request must not wait for their capture."""
    from dflashkit.decode.loop import DecodingGenerator

    captures: dict[str, int] = {}
    engine = _counting_engine(monkeypatch, captures)
    gen = DecodingGenerator(engine, rows=2, acceptance="rejection")
    gen.warm_up([5, 6, 7])
    assert captures["_sample"] == 2 and captures["_pick"] == 2, captures  # top-p on and off
    warm = dict(captures)
    for top_p, seed in ((1.0, 1), (0.9, 2)):
        params = dict(max_new_tokens=20, temperature=0.8, top_p=top_p, seed=seed, stop_ids=set())
        for step in gen.generate_batch([([9, 10, 11, 12], params), ([13, 14], dict(params, temperature=0.0))]):
            pass
    assert captures == warm, captures


def test_warm_up_makes_room_for_a_request_without_a_token_limit(monkeypatch):
    """A request without `max_tokens` reserves a long answer's room (`loop.RESERVE`, within the
    model's positions): after `warm_up` it must not grow the caches, which would drop every graph
    captured over their old buffers and capture them again while the request waits."""
    from dflashkit.decode.loop import DecodingGenerator

    captures: dict[str, int] = {}
    engine = _counting_engine(monkeypatch, captures)
    gen = DecodingGenerator(engine, rows=2)
    gen.warm_up([5, 6, 7])
    buffers = engine.cache.k.data_ptr(), engine.dcache.k.data_ptr()
    prompt = [9, 10, 11, 12]
    params = dict(max_new_tokens=engine.target.max_positions - len(prompt), temperature=0.0, top_p=1.0, seed=None,
                  stop_ids={engine.target.model.config.eos_token_id})
    for step in gen.generate_batch([(prompt, params)]):
        break  # the prefill has reserved the request's room
    assert (engine.cache.k.data_ptr(), engine.dcache.k.data_ptr()) == buffers


def test_packed_weights_decode_as_the_target():
    """On the CPU (fp32) the static engine multiplies by oneDNN's packed copies of the weights,
    the LM head's too: greedy AR and DFlash, alone and ragged, equal the unpacked engine's and
    the target's own `generate`; the modules keep their own weights."""
    from dflashkit.decode.loop import generate_batch

    target = make_tiny_target()
    drafter = make_tiny_drafter(target)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 120, (n,), generator=g) for n in (12, 30, 7)]
    packed, plain = static_engine(target, drafter), static_engine(target, drafter, pack=False)
    assert packed.run.packed and packed.run.tw[0].qkv.is_mkldnn and not target.layers[0].mlp.up_proj.weight.is_mkldnn
    # the drafter's projections too, on a copy: the caller's drafter keeps plain `nn.Linear`s
    linears = [m for m in packed.drafter.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is PackedLinear for m in linears) and packed.drafter is not drafter
    assert not any(type(m) is PackedLinear for m in drafter.modules())
    drafts = [e.draft(e.prefill([prompts[1]], capacity=64).argmax(-1)).logits for e in (packed, plain)]
    torch.testing.assert_close(drafts[0], drafts[1], rtol=1e-4, atol=1e-4)
    want = [target.model.generate(p[None], max_new_tokens=24, do_sample=False)[0, len(p):].tolist() for p in prompts]
    for method in ("ar", "dflash"):
        got = [x.tokens for x in generate_batch(packed, prompts, max_new_tokens=24, method=method)]
        assert got == want == [x.tokens for x in generate_batch(plain, prompts, max_new_tokens=24, method=method)]
    # One packed copy per weight for every engine over the target (an evaluation builds several),
    # made again once a weight changes in place.
    again = static_engine(target, drafter)
    assert again.run.tw[0].qkv is packed.run.tw[0].qkv and again.run.tw[1].down is packed.run.tw[1].down
    with torch.no_grad():
        target.layers[-1].mlp.down_proj.weight.copy_(torch.randn(target.layers[-1].mlp.down_proj.weight.shape, generator=g))
    changed = static_engine(target, drafter)
    assert changed.run.tw[-1].down is not packed.run.tw[-1].down and changed.run.tw[0].qkv is packed.run.tw[0].qkv
    before, want = want, [target.model.generate(p[None], max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
                          for p in prompts]
    assert want != before and [x.tokens for x in generate_batch(changed, prompts, max_new_tokens=24, method="ar")] == want


def test_few_query_attention_equals_sdpa():
    """The written-out attention of few-query CUDA passes gives SDPA's output under a tree's
    visibility: 2 rows of different lengths, 4 query heads over 2 KV heads folded as the engine
    folds them, 5 tree nodes over 24 slots."""
    torch.manual_seed(0)
    b, kv, g, t, n, d = 2, 2, 2, 5, 24, 8
    lengths = torch.tensor([7, 15])
    depths = torch.tensor([[0, 1, 1, 2, 3]] * 2)
    ancestors = torch.eye(t, dtype=torch.bool)[None].repeat(b, 1, 1)
    for child, parent in ((1, 0), (2, 0), (3, 1), (3, 0), (4, 3), (4, 1), (4, 0)):
        ancestors[:, child, parent] = True
    mask = folded_mask(visibility(lengths, depths, ancestors, n, None), g, torch.float32)
    q = torch.randn(b, kv, g * t, d)
    k, v = torch.randn(b, kv, n, d), torch.randn(b, kv, n, d)
    want = attend(q, k, v, mask, d ** -0.5)
    torch.testing.assert_close(attend_few(q, k, v, mask, d ** -0.5), want, rtol=1e-5, atol=1e-5)
    # the mask matters: without it the output differs
    assert not torch.allclose(attend_few(q, k, v, torch.zeros_like(mask), d ** -0.5), want, atol=1e-3)
    # the drafter's layout (heads unfolded, a [t, K] mask): the same rule as SDPA with GQA
    qh, dmask = torch.randn(1, kv * g, t, d), additive(torch.rand(1, 1, t, n) < 0.7, torch.float32)
    dmask[..., 0] = 0.0  # every query sees a key
    want = torch.nn.functional.scaled_dot_product_attention(qh, k[:1], v[:1], attn_mask=dmask, enable_gqa=True)
    torch.testing.assert_close(attend_heads(qh, k[:1], v[:1], dmask), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_an_engine_dropped_earlier_is_not_collected_inside_a_capture(monkeypatch):
    """An engine dropped while another captures its graphs (an evaluation builds engines per
    suite): its graphs, held in reference cycles, wait for the cyclic collector, which here is
    made to run inside the capture if it may (destroying a graph there invalidates the capture).
    The capture succeeds and the new engine decodes the target's own greedy tokens."""
    import gc

    from test_decode import greedy_reference

    target = make_tiny_target()
    target.model.cuda()
    drafter = make_tiny_drafter(target).cuda()
    prompt = torch.arange(3, 20, device="cuda")
    ref = greedy_reference(target, prompt[None], 12)
    old = [static_engine(target, drafter, cuda_graphs=True)]
    generate(old[0], prompt, max_new_tokens=12, method="dflash")
    begin, thresholds = torch.cuda.CUDAGraph.capture_begin, gc.get_threshold()

    def capture_begin(graph, *a, **kw):
        begin(graph, *a, **kw)
        if old:
            old.clear()  # the last reference: the engine is now garbage, in cycles
            gc.set_threshold(1, 1, 1)  # the collector runs at the next allocations, if enabled
            try:
                _ = [[] for _ in range(100)]
            finally:
                gc.set_threshold(*thresholds)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", capture_begin)
    new = static_engine(target, drafter, cuda_graphs=True)
    assert generate(new, prompt, max_new_tokens=12, method="dflash").tokens == ref
    assert not old


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("method,budget,top_p", [("dflash", None, 1.0), ("ddtree", 8, 0.9)])
def test_rejection_rule_from_graphs_draws_what_it_draws_eagerly(method, budget, top_p):
    """The rejection rule's steps replayed from CUDA graphs (`static._accept_graphs`) decode a
    sampled, seeded request token for token as the same engine with eager steps does, round after
    round (a graph's inputs are copied in at every replay, its outputs read before the next)."""
    from dflashkit.decode.generation import Sampling

    target = make_tiny_target()
    target.model.cuda()
    drafter = make_tiny_drafter(target).cuda()
    prompt = torch.arange(3, 20, device="cuda")
    kw = dict(max_new_tokens=40, method=method, budget=budget, acceptance="rejection", sampling=Sampling(0.8, top_p, 5))
    engines = [static_engine(target, drafter, cuda_graphs=True) for _ in range(2)]
    engines[1].accept_steps = Steps()  # the same engine, its rule's steps eager
    graphed, eager = (generate(e, prompt, **kw) for e in engines)
    assert (graphed.tokens, graphed.accept_lengths) == (eager.tokens, eager.accept_lengths)
