"""The captured decode (specdec/targets/compiled.py) against the eager forward it captures.

On the CPU the capture is ``torch.compile`` (inductor): the CUDA-graph part needs a GPU
(``python -m experiments.gpu_check`` runs it there). One bucket (2 rows x 4 tokens) keeps it to one
compilation (~45 s of CPU on 2 cores, cold)."""

from __future__ import annotations

import pytest
import torch

from specdec.targets.compiled import COMPILE_MODES, CompiledTarget, compile_target
from specdec.targets.llama import LlamaConfig, LlamaTarget
from tests._tiny import tiny_llama

MAX_LEN = 64


def _targets(**buckets):
    hf = tiny_llama(seed=3, init_std=0.2)  # a larger init: logits far apart, so greedy means something
    config, state = LlamaConfig.from_hf(hf.config), dict(hf.state_dict())
    eager = LlamaTarget(config, dict(state), linear_backend="reference")
    compiled = compile_target(LlamaTarget(config, state, linear_backend="reference"), "inductor", **buckets)
    return eager, compiled


@pytest.fixture(scope="module")
def pair():
    eager, compiled = _targets(row_buckets=(2,), token_buckets=(4,))
    return eager, compiled


def _prefill(targets, prompt_BT):
    outs = []
    for t in targets:
        t.reset(2, MAX_LEN)
        outs.append(t.forward(prompt_BT, torch.zeros(prompt_BT.shape[0], dtype=torch.long)))
    return outs


# Why a tolerance and not bitwise: the captured forward attends over all MAX_LEN slots (masked ones weigh
# exactly 0) where the eager one attends over the written ones, and inductor fuses the elementwise ops
# and reductions (RMSNorm, softmax) in another order; both change float32 rounding, ~1e-7 here.
ATOL = 1e-4


@pytest.mark.slow
def test_compiled_logits_equal_eager_and_greedy_tokens_are_identical(pair):
    eager, compiled = pair
    prompt = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    out_e, out_c = _prefill(pair, prompt)  # 7 tokens: past the 4-token bucket, so both run eagerly
    assert compiled.stats["eager"] >= 1 and torch.equal(out_e.logits_BTV, out_c.logits_BTV)
    tokens = [out_e.logits_BTV[:, -1].argmax(-1)]
    start = 7
    before = compiled.stats["compiled"]
    for _ in range(10):  # greedy decode, one token a step: the 1-token block padded to the bucket
        step = tokens[-1][:, None]
        le = eager.forward(step, torch.tensor([start, start])).logits_BTV
        lc = compiled.forward(step, torch.tensor([start, start])).logits_BTV
        assert lc.shape == le.shape == (2, 1, eager.vocab_size)
        torch.testing.assert_close(lc, le, atol=ATOL, rtol=0)
        assert torch.equal(lc.argmax(-1), le.argmax(-1))
        tokens.append(le[:, -1].argmax(-1))
        start += 1
    assert compiled.stats["compiled"] == before + 10
    # a verify block of 3 tokens (a draft of 2 after the last token), then the same with a roll back
    block = torch.stack([tokens[-1], tokens[1], tokens[2]], dim=1)
    le = eager.forward(block, torch.tensor([start, start])).logits_BTV
    lc = compiled.forward(block, torch.tensor([start, start])).logits_BTV
    torch.testing.assert_close(lc, le, atol=ATOL, rtol=0)
    assert torch.equal(lc.argmax(-1), le.argmax(-1))
    for t in pair:
        t.rollback(torch.tensor([start + 1, start]))
    le = eager.forward(block[:, :2], torch.tensor([start + 1, start])).logits_BTV
    lc = compiled.forward(block[:, :2], torch.tensor([start + 1, start])).logits_BTV
    torch.testing.assert_close(lc, le, atol=ATOL, rtol=0)
    assert torch.equal(compiled.cache.lengths_B, eager.cache.lengths_B)
    # the valid part of the cache holds the same keys and values
    for r, n in enumerate(eager.cache.lengths_B.tolist()):
        torch.testing.assert_close(compiled.cache.k_NBHLD[:, r, :, :n], eager.cache.k_NBHLD[:, r, :, :n])
        torch.testing.assert_close(compiled.cache.v_NBHLD[:, r, :, :n], eager.cache.v_NBHLD[:, r, :, :n])


@pytest.mark.slow
def test_blocks_outside_the_buckets_run_the_eager_forward(pair):
    eager, compiled = pair
    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    _prefill(pair, prompt)
    n_eager = compiled.stats["eager"]
    block = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(2))  # 5 > 4 tokens
    le = eager.forward(block, torch.tensor([6, 6])).logits_BTV
    lc = compiled.forward(block, torch.tensor([6, 6])).logits_BTV
    assert compiled.stats["eager"] == n_eager + 1 and torch.equal(lc, le)  # the same function: bitwise
    tree_TT = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a tree: eager too
    depth_T = torch.tensor([0, 1, 1])
    kw = {"tree_mask_TT": tree_TT, "depth_T": depth_T}
    le = eager.forward(block[:, :3], torch.tensor([11, 11]), **kw).logits_BTV
    lc = compiled.forward(block[:, :3], torch.tensor([11, 11]), **kw).logits_BTV
    assert compiled.stats["eager"] == n_eager + 2 and torch.equal(lc, le)
    # a block reaching past the cache's end once padded to the bucket runs eagerly as well
    for t in pair:
        t.rollback(torch.tensor([11, 11]))
    filler = torch.randint(0, 256, (2, MAX_LEN - 11 - 2), generator=torch.Generator().manual_seed(4))
    for t in pair:
        t.forward(filler, torch.tensor([11, 11]))
    last = torch.tensor([[1], [2]])
    le = eager.forward(last, torch.tensor([MAX_LEN - 2, MAX_LEN - 2])).logits_BTV
    lc = compiled.forward(last, torch.tensor([MAX_LEN - 2, MAX_LEN - 2])).logits_BTV
    assert compiled.stats["eager"] == n_eager + 4 and torch.equal(lc, le)


@pytest.mark.slow
def test_a_rows_logits_do_not_depend_on_the_bucket_padding(pair):
    _, compiled = pair
    prompt = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(5))
    compiled.reset(2, MAX_LEN)
    compiled.forward(prompt, torch.zeros(2, dtype=torch.long))
    k_before = compiled.cache.k_NBHLD[:, 0, :, :9].clone()
    n = compiled.stats["compiled"]
    tok = torch.tensor([[17]])
    # row 1 alone: padded with row 0 (its keys/values land past row 0's length) and 3 padding tokens
    alone = compiled.forward(tok, torch.tensor([9]), rows_B=torch.tensor([1])).logits_BTV
    assert torch.equal(compiled.cache.k_NBHLD[:, 0, :, :9], k_before)  # row 0's cache untouched
    assert compiled.cache.lengths_B.tolist() == [9, 10]
    compiled.rollback(torch.tensor([9]), rows_B=torch.tensor([1]))
    # row 1 beside row 0, the same token plus a second one after it (fewer padding tokens)
    both = compiled.forward(
        torch.tensor([[40, 41], [17, 99]]), torch.tensor([9, 9]), rows_B=torch.tensor([0, 1])
    ).logits_BTV
    assert compiled.stats["compiled"] == n + 2
    assert torch.equal(alone[0, 0], both[1, 0])  # bitwise: the same bucket, whatever fills the rest
    # rows in another order than the cache's: the outputs follow the block's order
    compiled.rollback(torch.tensor([9, 9]))
    swapped = compiled.forward(
        torch.tensor([[17, 99], [40, 41]]), torch.tensor([9, 9]), rows_B=torch.tensor([1, 0])
    ).logits_BTV
    assert torch.equal(swapped[0], both[1]) and torch.equal(swapped[1], both[0])


def test_compile_options_are_checked():
    hf = tiny_llama(seed=3)
    config, state = LlamaConfig.from_hf(hf.config), dict(hf.state_dict())
    target = LlamaTarget(config, state, linear_backend="reference")
    assert compile_target(target, "none") is target and COMPILE_MODES[0] == "none"
    with pytest.raises(ValueError, match="compile must be one of"):
        compile_target(target, "fast")
    with pytest.raises(ValueError, match="needs a CUDA target"):
        compile_target(target, "graphs")
    with pytest.raises(ValueError, match="row_buckets must be"):
        compile_target(target, "inductor", row_buckets=())
    with pytest.raises(ValueError, match="token_buckets must be"):
        compile_target(target, "inductor", token_buckets=(0, 4))
    with pytest.raises(ValueError, match="native target"):
        CompiledTarget(object(), mode="inductor")
    transposed = LlamaTarget(config, dict(tiny_llama(seed=3).state_dict()), linear_backend="transposed")
    assert isinstance(compile_target(transposed, "inductor"), CompiledTarget)  # a PyTorch backend: fine
    packed = LlamaTarget(config, dict(tiny_llama(seed=3).state_dict()), linear_backend="packed")
    with pytest.raises(ValueError, match="packed kernels"):
        compile_target(packed, "inductor")


def test_the_wrapper_is_the_target_for_everything_but_forward():
    from specdec.protocols import FeatureTarget, LayerTarget, TreeTarget

    hf = tiny_llama(seed=3)
    config, state = LlamaConfig.from_hf(hf.config), dict(hf.state_dict())
    compiled = compile_target(LlamaTarget(config, state, linear_backend="reference"), "inductor")
    assert isinstance(compiled, TreeTarget) and isinstance(compiled, FeatureTarget)
    assert isinstance(compiled, LayerTarget)
    assert compiled.vocab_size == config.vocab_size and compiled.config is compiled.target.config
    with pytest.raises(ValueError, match="call reset"):
        compiled.forward(torch.tensor([[1]]), torch.tensor([0]))
    compiled.reset(1, 8)
    with pytest.raises(ValueError, match="tokens_BT must be in"):
        compiled.forward(torch.tensor([[config.vocab_size]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="logits_index_BN"):
        compiled.forward(torch.tensor([[1, 2]]), torch.tensor([0]), logits_index_BN=torch.tensor([[2]]))


@pytest.mark.slow
def test_the_engine_decodes_the_same_greedy_tokens_through_the_captured_forward(pair):
    import specdec

    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9]]  # repeats: ngram drafts
    runs = []
    for t in pair:
        engine = specdec.Engine(t, drafter="ngram", gamma=3, max_num_seqs=2, max_model_len=MAX_LEN)
        ids = [engine.add_request(p, max_new_tokens=24, temperature=0.0, ignore_eos=True) for p in prompts]
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                done[out.request_id] = list(out.token_ids)
        runs.append([done[i] for i in ids])
    n = pair[1].stats["compiled"]
    assert runs[0] == runs[1] and all(len(r) == 24 for r in runs[0])
    assert n > 0  # the verify blocks (<= 4 tokens, 2 rows) ran captured


def test_load_target_and_the_commands_take_a_compile_mode(tmp_path):
    from specdec.cli import build_parser
    from specdec.targets import load_target, open_target
    from tests._tiny import save_tiny_checkpoint

    path = str(save_tiny_checkpoint(tmp_path / "tiny", seed=1))
    target = open_target(path, compile="inductor")
    assert isinstance(target, CompiledTarget) and target.linear_backend == "reference"
    assert not isinstance(load_target(path), CompiledTarget)
    with pytest.raises(ValueError, match="compile must be one of"):
        load_target(path, compile="fast")
    with pytest.raises(ValueError, match="needs the native target"):
        load_target(path, backend="hf", compile="inductor")
    args = build_parser().parse_args(["generate", "--prompt", "x", "--compile", "graphs"])
    assert args.compile == "graphs"
    assert build_parser().parse_args(["serve", "--compile", "inductor"]).compile == "inductor"
    assert build_parser().parse_args(["bench", "--compile", "inductor"]).compile == "inductor"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--compile", "fast"])


def test_the_server_config_takes_a_compile_mode():
    from specdec.serve.command import SERVE_PACKAGES

    for name in SERVE_PACKAGES:  # specdec.serve.server imports uvicorn and the app
        pytest.importorskip(name, reason="needs the [serve] extra (pip install -e '.[serve]')")
    from specdec.serve.server import ServeConfig

    assert ServeConfig(compile="graphs").compile == "graphs"
