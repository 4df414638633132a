"""Backends: one kind of recoverable unit each (a module with a cheap path and a recovery path).

- `bnb`: bitsandbytes `Linear8bitLt` (INT8, LLM.int8()) <-> a BF16 matmul (`bnb_int8`), and `Linear4bit` (QLoRA:
  NF4 or FP4) <-> a BF16 matmul (`bnb_4bit`); the BF16 weight from the original checkpoint or dequantized.
- `torchao`: torchao `Float8Linear` (FP8 training) <-> `F.linear` on the same master weight (`torchao_float8`).

What every backend shares lives beside them: `switch.py` (the forward switch, the ledger accounting and the
signal a unit is scored on), `adapters.py` (peft adapter discovery), `checkpoint.py` (the original weights in a
model's local safetensors). The registry, the options mechanism and `find_units` are in `gnmr_hf.units`.
"""
