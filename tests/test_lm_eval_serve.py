"""EleutherAI's lm-evaluation-harness against ``specdec serve --drafter default`` (``local-completions``).

Three local tasks (``tests/data/lm_eval/``: a YAML and a JSONL each) cover lm-eval's request types:
``generate_until`` (text up to a stop string), ``multiple_choice`` (loglikelihood: ``echo`` with
``logprobs`` and one generated token) and ``loglikelihood_rolling`` (perplexity windows), sent in
batches of prompts (``batch_size=4``) by two concurrent clients. Every task must finish with no
failed request (lm-eval logs a warning per failed call; the server counts every engine request) and
a finite metric. The server runs a tiny random Llama (``tests/_tiny.py``) whose tokenizer lm-eval
loads from the checkpoint's folder; nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _extras import skip_module_without

skip_module_without(
    ("lm_eval", "aiohttp", "tenacity", "requests", "tqdm", "fastapi", "uvicorn", "sse_starlette", "httpx"),
    extra="serve,eval",
)

from test_serve import metric, running, scrape, wait_idle  # noqa: E402

pytestmark = pytest.mark.slow  # lm-eval itself takes ~30-60 s to start on 2 busy cores

TASKS = Path(__file__).parent / "data" / "lm_eval"
# docs per task: generate_until one request each, multiple_choice one per choice, rolling one window each
EXPECTED_REQUESTS = {"specdec_gen": 4, "specdec_mc": 4 * 3, "specdec_rolling": 3}
LM_EVAL_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from _tiny import byte_tokenizer, save_tiny_checkpoint

    root = tmp_path_factory.mktemp("lm-eval")
    checkpoint = save_tiny_checkpoint(root / "tiny", tokenizer=byte_tokenizer())
    with running(checkpoint, root / "server.log", "--drafter", "default", "--max-num-seqs", "4") as s:
        yield s


def test_lm_eval_runs_every_task_type_with_no_failed_request(server, tmp_path):
    out = tmp_path / "results"
    model_args = ",".join(
        [
            f"model={server.model}",
            f"base_url={server.url}/v1/completions",
            f"tokenizer={server.model}",
            "tokenizer_backend=huggingface",
            "num_concurrent=2",
            "max_retries=1",
            "max_length=1024",
        ]
    )
    args = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args]
    args += ["--tasks", ",".join(EXPECTED_REQUESTS), "--include_path", str(TASKS), "--batch_size", "4"]
    args += ["--output_path", str(out)]
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    before = scrape(server)
    run = subprocess.run(
        args, cwd=TASKS, env=env, capture_output=True, text=True, timeout=LM_EVAL_TIMEOUT_S
    )  # the tasks' data_files are relative to their folder
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "API request failed" not in log and "Exception:" not in log, log[-4000:]
    (path,) = out.rglob("results_*.json")
    results = json.loads(path.read_text())["results"]
    assert set(results) == set(EXPECTED_REQUESTS)
    for task, values in results.items():
        numbers = {k: v for k, v in values.items() if isinstance(v, float) and "stderr" not in k}
        assert numbers and all(math.isfinite(v) for v in numbers.values()), (task, values)
    assert 0.0 <= results["specdec_mc"]["acc,none"] <= 1.0
    assert results["specdec_rolling"]["byte_perplexity,none"] > 1.0
    # the server ran every request lm-eval sent, none aborted
    after = wait_idle(server)
    done = {
        reason: metric(after, "vllm:request_success_total", finished_reason=reason)
        - metric(before, "vllm:request_success_total", finished_reason=reason)
        for reason in ("stop", "length", "abort")
    }
    assert done["abort"] == 0 and done["stop"] + done["length"] == sum(EXPECTED_REQUESTS.values()), done
