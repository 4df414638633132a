"""The built-in policies, one module each (`paper`, `cause`, `impact`), on the seam of `base` (imported by users as
`gnmr_hf.policy`). Each module lists its `Policy` classes in `POLICIES`; `builtin_policies` names every module, and
`gnmr_hf.policy`'s registry calls it the first time a policy is looked up, so `import gnmr_hf` imports none of them.
Adding a built-in policy is one new module here and one line in `builtin_policies`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Policy


def builtin_policies() -> tuple[type[Policy], ...]:
    """Every built-in policy class."""
    from . import cause, impact, paper

    return (*cause.POLICIES, *impact.POLICIES, *paper.POLICIES)
