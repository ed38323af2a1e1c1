"""Speculative decoding with exact verification.

    import specdec
    target = specdec.load_target("smollm2-135m")
    out = specdec.generate(target, [prompt_ids], drafter="ngram", temperature=0.0, max_new_tokens=64)

Importing this package registers nothing and loads no model code (plugins are imported when first
asked for by name).
"""

from specdec.loop import GenerationOutput, generate
from specdec.metrics import SpecMetrics, predicted_speedup
from specdec.policies import POLICIES, CostModelGamma, FixedGamma, GammaPolicy, HeuristicGamma, make_policy
from specdec.protocols import DecodeState, Drafter, Proposal, Target, TargetOutput
from specdec.registry import DRAFTERS, TARGETS, create_drafter
from specdec.sampling import SamplingParams, logits_to_probs, sample_from_probs
from specdec.targets import load_target
from specdec.verify import VerifyResult, rejection_sample

__all__ = [
    "generate",
    "GenerationOutput",
    "SpecMetrics",
    "predicted_speedup",
    "GammaPolicy",
    "FixedGamma",
    "HeuristicGamma",
    "CostModelGamma",
    "POLICIES",
    "make_policy",
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
