"""The continuous-batching engine: per-request state, a slot per request, one drafter for all.

``specdec.Engine`` (:mod:`specdec.engine.engine`) steps a scheduler (:mod:`specdec.engine.scheduler`:
admission, rows, budget, depths) whose plan (:mod:`specdec.engine.plan`) a runner carries out
(:mod:`specdec.engine.runner`: draft, verify, commit, observe, prefill) over units of rows
(:mod:`specdec.engine.units`). Requests and their outputs: :mod:`specdec.engine.request`; depth
policies: :mod:`specdec.engine.depth`; the verify-cost model: :mod:`specdec.engine.cost_model`; the
drafting cost: :mod:`specdec.engine.draft_cost`. ``specdec.generate`` is a thin driver over it
(:mod:`specdec.loop`).
"""

from specdec.engine.depth import DEPTH_POLICIES, DepthPolicy, make_depth_policy
from specdec.engine.engine import Engine
from specdec.engine.request import RequestMetrics, RequestOutput

__all__ = ["Engine", "RequestOutput", "RequestMetrics", "DepthPolicy", "DEPTH_POLICIES", "make_depth_policy"]
