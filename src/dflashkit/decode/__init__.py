"""Speculative decoding with a DFlash drafter: linear blocks (DFlash) and trees (DDTree), lossless.

Layering, leaf first (each module imports only those above it; `dflashkit.method` and
`dflashkit.kernels` sit below the whole package):

  generation.py  Sampling, the target's token per position, Generation, chunks, generator protocols
  tree.py        Tree, best-first building, the target's attention rule over a tree, the acceptance walk
  delta.py       Gated DeltaNet over a draft tree (hybrid targets)
  cache.py       KVCache: per-row slots, `commit` (the one rollback)
  engine.py      Engine: prefill / draft / verify / commit for b rows, built from a runner and `Parts`;
                 the Transformers runner
  static.py      the static runner: own layers, CUDA graphs (Llama/Qwen/Gemma-family targets)
  cost.py        cost-aware drafting: the verification cost curve, the best draft prefix, draft or not
  round.py       one speculative round: draft, tree, verify, accept, commit (AR = a round without draft)
  loop.py        the scheduler around the round: admissions, late reads, cost-aware sizing; streaming,
                 the server's generator
"""
