"""The built-in backends, one module each: `bnb` (bnb_int8, bnb_4bit), `torchao` (torchao_float8), `act_quant`,
`block_fp`. A module lists its `Backend` declarations in `BACKENDS`; `gnmr_hf.registry` finds them on first use.
Modules whose name starts with `_` are shared helpers (`_checkpoint`: the original weights of a quantized model).
"""
