"""Speculative verification: the rule contract, the chain and tree walks, keyed noise, the rules.

- :mod:`~specdec.verify.contract`: :class:`VerifyRule` (what a rule is given and returns) and the
  input checks;
- :mod:`~specdec.verify.noise`: public randomness keyed by (seed, position, stream);
- :mod:`~specdec.verify.token_tree`: a token tree's shape and a tree proposal;
- :mod:`~specdec.verify.chain` and :mod:`~specdec.verify.tree`: the rejection-sampling walks down a
  chain and down a token tree;
- :mod:`~specdec.verify.rule`: the rules' base; one file per rule: :mod:`~specdec.verify.exact`,
  :mod:`~specdec.verify.gumbel`, :mod:`~specdec.verify.lenient`; :mod:`~specdec.verify.registry`
  looks them up by name;
- :mod:`~specdec.verify.blocks`: what the engine runs for a proposal, chain or tree.
"""

from specdec.verify.chain import greedy_verify, rejection_sample
from specdec.verify.contract import VerifyResult, VerifyRule, validate_verify_inputs

__all__ = ["VerifyResult", "VerifyRule", "greedy_verify", "rejection_sample", "validate_verify_inputs"]
