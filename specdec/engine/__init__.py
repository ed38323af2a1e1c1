"""The continuous-batching engine: per-request state, a slot per request, one depth controller.

``specdec.Engine`` (:mod:`specdec.engine.engine`), requests and their outputs
(:mod:`specdec.engine.request`), depth policies (:mod:`specdec.engine.depth`), the verify-cost model
(:mod:`specdec.engine.cost_model`), drafters per request (:mod:`specdec.engine.drafting`), the decode
half of a step (:mod:`specdec.engine.decode`) over units of rows (:mod:`specdec.engine.units`).
``specdec.generate`` is a thin driver over it (:mod:`specdec.loop`).
"""

from specdec.engine.depth import DEPTH_POLICIES, DepthPolicy, make_depth_policy
from specdec.engine.engine import Engine
from specdec.engine.request import RequestMetrics, RequestOutput

__all__ = ["Engine", "RequestOutput", "RequestMetrics", "DepthPolicy", "DEPTH_POLICIES", "make_depth_policy"]
