"""Backends: one kind of recoverable unit each (a module with a cheap path and a recovery path).

- `bnb`: bitsandbytes `Linear8bitLt` (INT8, LLM.int8()) <-> a BF16 matmul (`bnb_int8`), and `Linear4bit` (QLoRA:
  NF4 or FP4) <-> a BF16 matmul (`bnb_4bit`); the BF16 weight from the original checkpoint or dequantized.
- `torchao`: torchao `Float8Linear` (FP8 training) <-> `F.linear` on the same master weight (`torchao_float8`).
- `act_quant`: the activations a Linear (its input) or an attention (q, k, v) saves for backward, at k bits <->
  m bits (`act_quant`).
- `block_fp`: every GEMM input of an `nn.Linear` (forward and backward) on block-scaled low-bit floats, DeepSeek-V3
  style (1x128 tiles, 128x128 weight blocks) or MX: FP4/FP6 <-> FP8 or BF16, emulated on the CPU (`block_fp`).

What every backend shares lives beside them: `switch.py` (the forward switch, the ledger accounting and the
signal a unit is scored on), `adapters.py` (peft adapter discovery), `checkpoint.py` (the original weights in a
model's local safetensors). The registry, the options mechanism and `find_units` are in `gnmr_hf.units`.
"""
