"""Policies as a user meets them: the seam every policy fills in, and the registry that a config's `policy` names.

A `Policy` turns one optimizer step's `Scores` (GNMR, DGNMR, risk, who is risky, what each unit's cheap path lost)
into a `Choice`: the units that run on the recovery path from the next step on. The seam (`Scores`, `Choice`,
`Policy`, `PolicyOptions`, the budget `within_budget`, the relapse-aware `RelapseLock`) is defined in
`gnmr_hf.policies.base` and imported from here or from `gnmr_hf`. A new policy is one subclass and one
`register_policy` call, and `GNMRConfig(policy=name, policy_options=...)` chooses it, as `GNMRConfig(backend=...)`
chooses a backend. The built-in policies are listed in `gnmr_hf.policies.builtin_policies` and imported on the first
lookup; the registry is the generic one of `gnmr_hf.registry_base`, as the backends' is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .policies.base import (
    FIDELITY_ROWS,
    NEVER,
    Choice,
    Policy,
    PolicyOptions,
    RelapseLock,
    Scores,
    half_lock,
    load_tensor,
    top_indices,
    within_budget,
)
from .registry_base import Registry

if TYPE_CHECKING:
    from .config import GNMRConfig

__all__ = [
    "FIDELITY_ROWS",
    "NEVER",
    "Choice",
    "Policy",
    "PolicyOptions",
    "RelapseLock",
    "Scores",
    "get_policy",
    "half_lock",
    "known_policies",
    "load_tensor",
    "make_policy",
    "register_policy",
    "top_indices",
    "within_budget",
]


def _builtin_policies() -> tuple[type[Policy], ...]:
    from .policies import builtin_policies

    return builtin_policies()


# Policy names are listed alphabetically with a close-match hint, as `--policy` errors have always shown them.
_POLICIES: Registry[type[Policy]] = Registry(
    "policy", "policies", _builtin_policies, lambda policy: policy.name, suggest=True, sort_names=True
)


def register_policy(policy: type[Policy]) -> type[Policy]:
    """Make `GNMRConfig(policy=policy.name)` choose `policy` (a `Policy` subclass); returns it (a decorator too)."""
    if not (isinstance(policy, type) and issubclass(policy, Policy)):
        raise TypeError(f"register_policy: policy must be a gnmr_hf.Policy subclass, got {policy!r}")
    if not isinstance(policy.name, str) or not policy.name:
        raise ValueError(f"register_policy: {policy.__name__}.name must be a non-empty string, got {policy.name!r}")
    options = policy.options
    if not (isinstance(options, type) and issubclass(options, PolicyOptions)):
        raise TypeError(
            f"register_policy: {policy.__name__}.options must be a PolicyOptions dataclass, got {options!r}"
        )
    return _POLICIES.register(policy)


def known_policies() -> list[str]:
    """The policy names `GNMRConfig.policy` accepts now, built-in and registered, sorted."""
    return _POLICIES.names()


def get_policy(name: str) -> type[Policy]:
    """The policy class registered as `name`; a ValueError naming the known ones otherwise."""
    return _POLICIES.get(name)


def make_policy(config: GNMRConfig) -> Policy:
    """`config.policy`'s policy with its `config.policy_options`; errors name the field and what is allowed."""
    try:
        cls = get_policy(config.policy)
    except ValueError as err:
        raise ValueError(f"GNMRConfig.policy: {err}") from None
    try:
        options = cls.options.parse(config.policy_options)
    except (TypeError, ValueError) as err:
        raise type(err)(f"GNMRConfig.policy_options: {cls.name} {err}") from None
    return cls(config, options)
