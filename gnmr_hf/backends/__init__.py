"""The built-in backends, one module each: `bnb` (bnb_int8, bnb_4bit), `torchao` (torchao_float8), `act_quant`,
`block_fp`. A module lists its `Backend` declarations in `BACKENDS`; `builtin_backends` names every module, and
`gnmr_hf.registry` calls it the first time a backend is looked up, so `import gnmr_hf` imports none of them (and
each imports its optional library, bitsandbytes or torchao, only when it matches a unit). Adding a built-in backend
is one new module here and one line in `builtin_backends`. Modules whose name starts with `_` are shared helpers
(`_checkpoint`: the original weights of a quantized model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..units import Backend


def builtin_backends() -> tuple[Backend, ...]:
    """Every built-in backend, in the order `gnmr_hf.registry.known_backends` lists them."""
    from . import act_quant, block_fp, bnb, torchao

    return (*act_quant.BACKENDS, *block_fp.BACKENDS, *bnb.BACKENDS, *torchao.BACKENDS)
