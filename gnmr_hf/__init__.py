"""gnmr-hf: GNMR (Gradient Norm-to-Mean Ratio, arXiv 2606.00539) for the HuggingFace stack.

GNMR watches each recoverable module's gradient norm and moves the few riskiest modules from a cheap,
low-precision path to a high-fidelity path under a hard budget (`max_active`) and a lock window
(`lock_steps`), then back.

    from gnmr_hf import GNMRCallback, GNMRConfig
    trainer.add_callback(GNMRCallback(GNMRConfig(max_active=4)))

`import gnmr_hf` is light: only the config (plain Python) is loaded with the package; everything else on first use
of its name. The controller, units and signals need torch (most of a second to import, more on a busy machine, which
`gnmr-hf --help` would pay for nothing), and the Trainer integration imports transformers, and through it
bitsandbytes and peft when they are installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import GNMRConfig
from .options import BackendOptions

if TYPE_CHECKING:
    from .callback import GNMRCallback
    from .controller import Decision, GNMRController, HostDecision
    from .planning import ImpactRanking, plan
    from .policy import Choice, Policy, PolicyOptions, Scores, get_policy, register_policy
    from .registry import find_units, get_backend, register_backend
    from .signals import OutputGradMeter, Signal, SignalOptions, UnitSignals
    from .trainer import GNMRTrainer
    from .units import (
        Backend,
        DispatchContext,
        RecoverableUnit,
        RecoveryLedger,
        SwitchedUnit,
        UnitSet,
        apply_decision,
    )

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendOptions",
    "Choice",
    "Decision",
    "DispatchContext",
    "GNMRCallback",
    "GNMRConfig",
    "GNMRController",
    "GNMRTrainer",
    "HostDecision",
    "ImpactRanking",
    "OutputGradMeter",
    "Policy",
    "PolicyOptions",
    "RecoverableUnit",
    "RecoveryLedger",
    "Scores",
    "Signal",
    "SignalOptions",
    "SwitchedUnit",
    "UnitSet",
    "UnitSignals",
    "__version__",
    "apply_decision",
    "find_units",
    "get_backend",
    "get_policy",
    "plan",
    "register_backend",
    "register_policy",
]

# Each public name that needs torch, and the module that defines it (imported on first use).
_LAZY = {
    **dict.fromkeys(("Decision", "GNMRController", "HostDecision"), ".controller"),
    **dict.fromkeys(("Choice", "Policy", "PolicyOptions", "Scores", "get_policy", "register_policy"), ".policy"),
    **dict.fromkeys(("find_units", "get_backend", "register_backend"), ".registry"),
    **dict.fromkeys(("OutputGradMeter", "Signal", "SignalOptions", "UnitSignals"), ".signals"),
    **dict.fromkeys(("Backend", "DispatchContext", "RecoverableUnit", "RecoveryLedger"), ".units"),
    **dict.fromkeys(("SwitchedUnit", "UnitSet", "apply_decision"), ".units"),
    **dict.fromkeys(("ImpactRanking", "plan"), ".planning"),
    "GNMRCallback": ".callback",
    "GNMRTrainer": ".trainer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gnmr_hf' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
