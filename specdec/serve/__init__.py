"""``specdec serve``: an OpenAI-compatible streaming server on the continuous-batching engine.

One engine thread owns the target and the :class:`specdec.Engine` (:mod:`~specdec.serve.worker`);
the HTTP side, a FastAPI app on uvicorn (:mod:`~specdec.serve.app`), talks to it through queues.
Body limits and the intake thread (:mod:`~specdec.serve.intake`), request checks
(:mod:`~specdec.serve.protocol`), chat messages to token ids (:mod:`~specdec.serve.chat`), admission
against the waiting-queue limit and each engine request's ticket (:mod:`~specdec.serve.tickets`),
CORS (:mod:`~specdec.serve.cors`), response shapes (:mod:`~specdec.serve.responses`),
a choice's text and log-probabilities (:mod:`~specdec.serve.choices`, :mod:`~specdec.serve.logprobs`),
errors (:mod:`~specdec.serve.errors`), incremental text (:mod:`~specdec.serve.detokenize`),
Prometheus metrics (:mod:`~specdec.serve.metrics`), the process and its shutdown
(:mod:`~specdec.serve.server`), the command line (:mod:`~specdec.serve.command`). Needs the
``[serve]`` extra; importing this package imports none of it. See docs/serving.md.
"""
