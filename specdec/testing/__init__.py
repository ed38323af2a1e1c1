"""Distribution-equivalence testing for speculative decoding: does a verifier keep the target's
distribution exactly?

- :func:`expected_output_distribution`: the exact law of what a speculative step (or the first m
  tokens of a whole generation) emits on toy models, every verify path evaluated through the real
  verifier (:func:`verifier_step_law`); :func:`target_sequence_distribution`: the target's own joint.
- :func:`sample_output_distribution`: Monte-Carlo counts through the real
  :func:`specdec.verify.rejection_sample` (or your verifier with the same signature) or the real
  :func:`specdec.generate` (the engine).
- :func:`assert_same_distribution`: G-test / χ² with a stated false-alarm rate, zero-probability
  cells checked exactly, small cells pooled; reports the p-value and the worst cells.
- :func:`required_sample_size` / :func:`detection_power`: N needed to detect a total-variation bias.
- :func:`keyed_randomness` / :func:`with_generator`: keyed noise drawn from a ``torch.Generator``,
  and the adapter that runs a keyed verifier where a generator is handed over (a third party's
  verifier with the generator signature runs through every helper as it is).
- :mod:`specdec.testing.toy`: Markov toy models, also behind the Target / Drafter protocols.

See docs/testing.md for a walk-through with your own verifier.
"""

from specdec.testing.distributions import marginalize, total_variation
from specdec.testing.enumeration import (
    expected_num_accepted_distribution,
    expected_output_distribution,
    target_sequence_distribution,
)
from specdec.testing.goodness_of_fit import Cell, GoodnessOfFit, assert_same_distribution, goodness_of_fit
from specdec.testing.keyed import keyed_randomness, with_generator
from specdec.testing.monte_carlo import sample_output_distribution
from specdec.testing.power import detection_power, required_sample_size
from specdec.testing.probe import ProbeError, StepOutcome, verifier_step_law
from specdec.testing.toy import MarkovDrafter, MarkovModel, MarkovTarget, NextTokenModel, PositionalModel

__all__ = [
    "expected_output_distribution",
    "expected_num_accepted_distribution",
    "target_sequence_distribution",
    "verifier_step_law",
    "StepOutcome",
    "ProbeError",
    "sample_output_distribution",
    "keyed_randomness",
    "with_generator",
    "assert_same_distribution",
    "goodness_of_fit",
    "GoodnessOfFit",
    "Cell",
    "required_sample_size",
    "detection_power",
    "marginalize",
    "total_variation",
    "NextTokenModel",
    "MarkovModel",
    "PositionalModel",
    "MarkovTarget",
    "MarkovDrafter",
]
