"""Speculative decoding with exact verification.

    import specdec
    target = specdec.load_target("smollm2-135m")
    out = specdec.generate(target, [prompt_ids], drafter="ngram", temperature=0.0, max_new_tokens=64)

Importing this package registers nothing, loads no model code and imports neither torch nor any
submodule: each public name is imported from its module on first use, plugins when first asked for
by name.
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdec.engine import Engine, RequestOutput
    from specdec.engine.depth import DEPTH_POLICIES, DepthPolicy, make_depth_policy
    from specdec.loop import GenerationOutput, generate
    from specdec.metrics import SpecMetrics, predicted_speedup
    from specdec.protocols import DecodeState, Drafter, Proposal, Target, TargetOutput
    from specdec.registry import DRAFTERS, TARGETS, create_drafter
    from specdec.sampling import SamplingParams, logits_to_probs, sample_from_probs
    from specdec.targets import load_target
    from specdec.verify import VerifyResult, rejection_sample

# The public names and the module each comes from, imported on first use (PEP 562): ``import specdec``
# stays light, so the ``specdec`` command can answer Ctrl-C during its heavy imports (specdec.cli).
_EXPORTS = {
    "generate": "specdec.loop",
    "Engine": "specdec.engine",
    "RequestOutput": "specdec.engine",
    "GenerationOutput": "specdec.loop",
    "SpecMetrics": "specdec.metrics",
    "predicted_speedup": "specdec.metrics",
    "DepthPolicy": "specdec.engine.depth",
    "DEPTH_POLICIES": "specdec.engine.depth",
    "make_depth_policy": "specdec.engine.depth",
    "Target": "specdec.protocols",
    "TargetOutput": "specdec.protocols",
    "Drafter": "specdec.protocols",
    "Proposal": "specdec.protocols",
    "DecodeState": "specdec.protocols",
    "DRAFTERS": "specdec.registry",
    "TARGETS": "specdec.registry",
    "create_drafter": "specdec.registry",
    "load_target": "specdec.targets",
    "SamplingParams": "specdec.sampling",
    "logits_to_probs": "specdec.sampling",
    "sample_from_probs": "specdec.sampling",
    "rejection_sample": "specdec.verify",
    "VerifyResult": "specdec.verify",
}

__all__ = [
    "generate",
    "Engine",
    "RequestOutput",
    "GenerationOutput",
    "SpecMetrics",
    "predicted_speedup",
    "DepthPolicy",
    "DEPTH_POLICIES",
    "make_depth_policy",
    "Target",
    "TargetOutput",
    "Drafter",
    "Proposal",
    "DecodeState",
    "DRAFTERS",
    "TARGETS",
    "create_drafter",
    "load_target",
    "SamplingParams",
    "logits_to_probs",
    "sample_from_probs",
    "rejection_sample",
    "VerifyResult",
]


def __getattr__(name: str) -> Any:
    """A public name (imported from its module on first use) or a submodule (``specdec.loop``)."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
