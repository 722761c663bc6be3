"""Kernels below the model pieces: the drafter (`drafter.py`) and the decoding package both run on them.

  heads.py   one Triton kernel for a layer's q/k/v heads: head norms, RoPE, the queries' layout,
             the key/value stores (CUDA)
  packed.py  oneDNN's packed weights on a CPU: linear, pack_weight, PackedLinear, lm_head
"""
