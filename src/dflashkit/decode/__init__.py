"""Speculative decoding with a DFlash drafter: linear blocks (DFlash) and trees (DDTree), lossless.

Layering, leaf first (each module imports only those above it):

  generation.py  Sampling, the target's token per position, Generation, chunks, generator protocols
  tree.py        Tree, best-first building, the target's attention rule over a tree, the acceptance walk
  cache.py       KVCache: per-row slots, `commit` (the one rollback)
  engine.py      Engine: prefill / draft / verify / commit for b rows; the Transformers runner
  static.py      the static runner: own layers, CUDA graphs (Llama/Qwen/Gemma-family targets)
  cost.py        cost-aware drafting: the verification cost curve, the best draft prefix
  loop.py        the one round loop (AR = a round without draft), streaming, the server's generator,
                 the `generate` command
"""
