"""The EAGLE draft head and drafters (chain and tree) on a tiny random Llama, plus the real model.

The tiny head is trained for a few seconds on the tiny target's own greedy continuations (the
real recipe's loss), so drafts do get accepted and the ragged-acceptance paths run.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _reference import SMOLLM2_NEW_TOKENS as N
from _tiny import fit_tiny_head, greedy_training_block, save_tiny_checkpoint, tiny_llama

import specdec
from specdec.drafters.eagle import (
    EagleCache,
    EagleDrafter,
    PackedEagleHead,
    draft_distribution,
    eagle_tree,
    load_eagle_head,
)
from specdec.drafters.eagle.train.config import TrainConfig
from specdec.drafters.eagle.train.objective import unrolled_features
from specdec.protocols import DecodeState, DraftCall, Proposal
from specdec.registry import create_drafter
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.targets.hf import HFTarget
from specdec.targets.llama import LlamaTarget


def _train_tiny_head(
    target,
    hf,
    parts,
    seqs,
    out,
    weights,
    prev_token_input: bool = False,
    seed: int | None = None,
) -> list[float]:
    """Train a tiny head on the target's greedy continuations (the recipe's loss), save it to
    ``weights``; returns its top-1 agreement with the target per step (teacher-forced step).
    ``seed``: seed the head's initialisation (None: the global generator as it stands)."""
    cfg = TrainConfig(unroll=2, feature_noise=0.0)
    history = fit_tiny_head(
        hf, parts, seqs, out, cfg, weights, target_name="tiny", seed=seed, prev_token_input=prev_token_input
    )
    return [h["acc1"] for h in history]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama target and a head trained on its greedy continuations; returns a dict."""
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3)
    target = LlamaTarget.from_pretrained(path)
    hf = tiny_llama(seed=3)
    parts = target.parts()
    seqs, out = greedy_training_block(hf, target)
    weights = tmp_path_factory.mktemp("head") / "head.safetensors"
    accuracy = _train_tiny_head(target, hf, parts, seqs, out, weights)
    return {
        "path": path,
        "target": target,
        "hf": hf,
        "weights": weights,
        "accuracy": accuracy,
        "parts": parts,
        "seqs": seqs,
        "out": out,
    }


@pytest.fixture(scope="module")
def tiny_prev(tiny, tmp_path_factory):
    """``tiny`` with a head that also takes the previous token (``prev_token_input``)."""
    weights = tmp_path_factory.mktemp("head-prev") / "head.safetensors"
    args = (tiny["target"], tiny["hf"], tiny["parts"], tiny["seqs"], tiny["out"], weights)
    accuracy = _train_tiny_head(*args, prev_token_input=True, seed=0)
    return {**tiny, "weights": weights, "accuracy": accuracy}


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 9, 3)]


def _options(tiny, drafter: str) -> dict:
    """The tiny head's weights, with the combined drafters' stop rules off: the tiny head is unsure
    (top probabilities ~1/200), so their tuned defaults would leave it no drafts to test."""
    stops = {"ngram-eagle": {"min_prob": 0.0}, "ngram-eagle-tree": {"tree_min_prob": 0.0}}
    return {"weights": str(tiny["weights"]), **stops.get(drafter, {})}


def _generate(tiny, rows: list[list[int]], drafter: str, options: dict | None = None, **sampling):
    """``specdec.generate`` on the tiny target with ``drafter`` over the tiny head (:func:`_options`,
    then ``options``), EOS ignored."""
    options = {**_options(tiny, drafter), **(options or {})}
    return specdec.generate(
        tiny["target"], rows, drafter=drafter, drafter_options=options, ignore_eos=True, **sampling
    )


def test_training_learns_the_targets_next_tokens(tiny):
    accuracy = tiny["accuracy"]
    assert accuracy[0] < 0.1 and min(accuracy[-10:]) > 0.3


def test_prev_token_training_learns_the_targets_next_tokens(tiny_prev):
    accuracy = tiny_prev["accuracy"]
    assert accuracy[0] < 0.1 and min(accuracy[-10:]) > 0.3
    head, _ = load_eagle_head(tiny_prev["weights"], tiny_prev["parts"])
    assert head.config.prev_token_input and head.fc.weight.shape[1] == 3 * 64


# --- a head that also takes the previous token (prev_token_input) ---------------------------------
def _reference_logits(head, feats_TD, committed: list[int], path: list[int], prev_offset: int = 1):
    """Draft logits after chain-drafting ``path`` from the ``committed`` tokens (whose target features
    are ``feats_TD``), by re-running the reference forward over the whole sequence of triples
    ``(f_t, x_{t+1}, x_t)`` at each step: no cache, no drafter bookkeeping. ``prev_offset`` != 1
    feeds a wrong "previous" token (the test's check that the comparison can fail)."""
    seq = committed + path
    n = len(committed)
    feats = list(feats_TD[: n - 1])
    for _ in range(len(path) + 1):
        T = len(feats)
        nxt = torch.tensor([seq[1 : T + 1]])
        prev = torch.tensor([[seq[max(0, t + 1 - prev_offset)] for t in range(T)]])
        f_hat = head(torch.stack(feats).unsqueeze(0), nxt, prev)[0, -1]
        feats.append(f_hat)
    return head.logits(f_hat)


def _recording(target, weights, **options):
    """An EAGLE drafter that logs, for its one request, (committed tokens, the step's proposal: a chain
    or a tree :class:`Proposal`) at every drafting step."""

    class Recording(EagleDrafter):
        def propose(self, call):
            p = super().propose(call)
            state = call.state
            if call.depths[0] > 0:
                n = int(state.lengths_B[0])
                step = p.tree if p.tree is not None else Proposal(p.tokens_T[None], None)
                self.log.append((state.tokens_BL[0, :n].tolist(), step))
            return p

    d = Recording(target, weights=weights, weight_dtype="float32", **options)
    d.log = []
    return d


def _features(target, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        target.reset(1, len(tokens))
        return target.forward(torch.tensor([tokens]), torch.zeros(1, dtype=torch.long)).hidden_BTD[0].clone()


def _in_top(logits_N, token_index: int, k: int, tol: float = 1e-3) -> bool:
    """The token is among the k largest logits, up to ``tol`` (float ties between the paths)."""
    return bool(logits_N[token_index] >= logits_N.topk(k).values[-1] - tol)


@pytest.mark.parametrize("tree", [None, "small", "dynamic"])
def test_prev_token_head_drafts_equal_recomputing_the_reference_forward(tiny_prev, tree):
    """The drafter feeds the right previous token everywhere (catch-up, each chain step, each tree
    node, the root's children): every draft equals re-running the head's reference forward over the
    whole committed + drafted sequence; a previous token off by one would not."""
    target, weights = tiny_prev["target"], tiny_prev["weights"]
    head, _ = load_eagle_head(weights, tiny_prev["parts"])
    index_V = torch.full((259,), -1, dtype=torch.long)
    index_V[head.draft_vocab_N] = torch.arange(head.draft_vocab_N.numel())
    if tree is None:
        d = _recording(target, weights)
    else:
        d = _recording(target, weights, trees="always", tree=tree, tree_width=3)
    prompt = _prompts()[1]
    specdec.generate(
        target, [prompt], drafter=d, max_new_tokens=16, temperature=0.0, gamma=3, ignore_eos=True
    )
    checked = wrong_prev_differs = 0
    with torch.no_grad():
        for committed, proposal in d.log[:4]:
            feats = _features(target, committed)
            if proposal.tree is None:
                nodes = [
                    (list(proposal.tokens_BK[0, :k].tolist()), int(proposal.tokens_BK[0, k]), 1)
                    for k in range(proposal.tokens_BK.shape[1])
                ]
            else:
                tr, toks = proposal.tree.tree, proposal.tree.tokens_BN[0].tolist()
                nodes = []
                for c in range(1, tr.num_nodes):
                    path, a = [], tr.parents[c]
                    while a > 0:
                        path.insert(0, toks[a])
                        a = tr.parents[a]
                    nodes.append((path, toks[c], 3 if tree == "dynamic" else len(tr.children[tr.parents[c]])))
            for path, token, k in nodes:
                ref = _reference_logits(head, feats, committed, path)
                assert _in_top(ref, int(index_V[token]), k), (committed, path, token)
                bad = _reference_logits(head, feats, committed, path, prev_offset=0)
                wrong_prev_differs += not _in_top(bad, int(index_V[token]), k)
                checked += 1
    assert checked >= 6 and wrong_prev_differs > 0


def test_prev_token_head_cache_and_packed_paths_equal_the_reference(tiny_prev):
    """Cache steps (a block, a token, a block) and the packed fast path with the x_t block equal the
    reference forward; a head with prev_token_input refuses to run without x_t."""
    parts = tiny_prev["parts"]
    head, _ = load_eagle_head(tiny_prev["weights"], parts)
    packed = PackedEagleHead(head, backend="auto", weight_dtype=torch.float32)
    assert head.fc.weight.shape[1] == 3 * 64
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(2, 11, 64, generator=g) * 0.05
    tokens = torch.randint(0, 259, (2, 12), generator=g)
    nxt, prev = tokens[:, 1:], tokens[:, :-1]
    with torch.no_grad():
        ref = head(feats, nxt, prev)
        assert (ref - head(feats, nxt, nxt)).abs().max() > 1e-3 * ref.abs().max()  # x_t matters
        for h in (head, packed):
            cache = EagleCache(h, 2, 4)  # grows on demand
            outs = []
            for a, b in [(0, 4), (4, 5), (5, 11)]:
                slots = torch.arange(a, b).expand(2, -1)
                visible = torch.arange(b) <= slots.unsqueeze(-1)
                outs.append(cache.step(h, feats[:, a:b], nxt[:, a:b], slots, slots, visible, prev[:, a:b]))
            torch.testing.assert_close(torch.cat(outs, 1), ref, atol=1e-4, rtol=1e-4)
        with pytest.raises(ValueError, match="prev_tokens_BT"):
            head(feats, nxt)
        with pytest.raises(ValueError, match="prev_tokens_BT"):
            head(feats, nxt, prev[:, :3])


@pytest.mark.parametrize("step", [1, 3])
def test_prev_token_unrolled_training_equals_inference_drafting(tiny_prev, step):
    """Training-time test with x_t: unrolled step s at t == the s-th draft at inference."""
    head, _ = load_eagle_head(tiny_prev["weights"], tiny_prev["parts"])
    g = torch.Generator().manual_seed(1)
    T = 9
    feats = torch.randn(1, T, 64, generator=g) * 0.05
    tokens = torch.randint(0, 259, (1, T + 1), generator=g)
    nxt, cur = tokens[:, 1:], tokens[:, :-1]
    with torch.no_grad():
        preds = unrolled_features(head, feats, nxt, step, cur)
        for m in range(0, T - step + 1):
            cache = EagleCache(head, 1, T)
            slots = torch.arange(m + 1).unsqueeze(0)
            vis = torch.arange(m + 1) <= slots.unsqueeze(-1)
            f = cache.step(head, feats[:, : m + 1], nxt[:, : m + 1], slots, slots, vis, cur[:, : m + 1])[
                :, -1:
            ]
            for r in range(2, step + 1):
                s = m + r - 1
                slot = torch.tensor([[s]])
                vis = torch.arange(s + 1) <= slot.unsqueeze(-1)
                f = cache.step(head, f, nxt[:, s : s + 1], slot, slot, vis, cur[:, s : s + 1])
            torch.testing.assert_close(f[0, 0], preds[step - 1][0, m + step - 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("drafter", ["eagle", "eagle-tree", "ngram-eagle"])
def test_prev_token_head_greedy_equals_plain_decoding_ragged_batch(tiny_prev, drafter):
    target, prompts = tiny_prev["target"], _prompts()
    kw = {"max_new_tokens": 24, "temperature": 0.0}
    ref = specdec.generate(target, prompts, drafter="none", ignore_eos=True, **kw)
    out = _generate(tiny_prev, prompts, drafter, gamma=4, **kw)
    assert out.token_ids == ref.token_ids
    assert out.metrics.num_accepted > 0


def test_cache_steps_equal_the_reference_forward(tiny):
    head, _ = load_eagle_head(tiny["weights"], tiny["parts"])
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(2, 11, 64, generator=g)
    tokens = torch.randint(0, 259, (2, 11), generator=g)
    with torch.no_grad():
        ref = head(feats, tokens)
        cache = EagleCache(head, 2, 4)  # grows on demand
        outs = []
        for a, b in [(0, 4), (4, 5), (5, 11)]:  # a block, one token, a block
            slots = torch.arange(a, b).expand(2, -1)
            visible = torch.arange(b) <= slots.unsqueeze(-1)
            outs.append(cache.step(head, feats[:, a:b], tokens[:, a:b], slots, slots, visible))
    torch.testing.assert_close(torch.cat(outs, 1), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_packed_fused_head_equals_the_module_path(tiny, backend, B):
    """PackedEagleHead: scales, residuals, norms and SwiGLU fused into the linear kernels and rope
    done with fewer ops compute the same function as the EagleHead module (a block, then chain
    steps)."""
    plain, _ = load_eagle_head(tiny["weights"], tiny["parts"])
    packed = PackedEagleHead(plain, backend=backend)
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(B, 5, 64, generator=g) * 3
    tokens = torch.randint(0, 259, (B, 7), generator=g)
    outs: list[list[torch.Tensor]] = [[], []]
    with torch.no_grad():
        caches = [EagleCache(head, B, 4) for head in (plain, packed)]  # grow on demand
        slots = torch.arange(5).expand(B, -1)
        visible = torch.arange(5) <= slots.unsqueeze(-1)
        inputs = [feats, feats]
        for s in (None, 5, 6):  # a block, then two chain draft steps on the head's own features
            for i, head in enumerate((plain, packed)):
                if s is None:
                    f = caches[i].step(head, inputs[i], tokens[:, :5], slots, slots, visible)
                else:
                    slot = torch.full((B, 1), s)
                    f = caches[i].step(head, inputs[i], tokens[:, s : s + 1], slot, slot, None)
                outs[i] += [f, head.logits(f)]
            # Both paths continue from the plain path's features: the chain feeds a head's output back
            # scaled by feature_scale (~30 for the tiny target), which would compound float rounding
            # step by step; the claim under test is that one application computes the same function.
            inputs = [outs[0][-2][:, -1:]] * 2
    for got, want in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert outs[0][-1].abs().max() > 0.1


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_an_int8_head_runs_q8a8_logits_and_int8_layer_rows(tiny, backend):
    """``int8``: the draft LM head's rows as int8 with 8-bit activations (as a gguf-q8 target runs
    its own head): the q8a8 oracle's function of the same rows and normed feature, close to the
    float head's logits; the layer's products int8 rows with float activations, close to the
    float layer's; fc stays float."""
    from kernels.q8_reference import linear_a8_reference
    from kernels.quant import quantize_int8

    plain, _ = load_eagle_head(tiny["weights"], tiny["parts"])
    packed, float_head = (
        PackedEagleHead(plain, backend=backend, int8=True),
        PackedEagleHead(plain, backend=backend),
    )
    assert packed.lm_head.format == "q8a8" and float_head.lm_head.format != "q8a8"
    layer = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert [getattr(packed, k).format for k in layer] == [
        "q8"
    ] * 4 and packed.fc.format == float_head.fc.format
    g = torch.Generator().manual_seed(4)
    f_BTD = torch.randn(2, 3, 64, generator=g) * 3
    with torch.no_grad():
        want = plain.logits(f_BTD)
        normed = torch.nn.functional.rms_norm(f_BTD, (64,), plain.norm_D.float(), plain.norm_eps)
        exact = linear_a8_reference(normed.reshape(6, 64), quantize_int8(plain.head_ND.float())).reshape(
            2, 3, -1
        )
        got = packed.logits(f_BTD)
    torch.testing.assert_close(got, exact, atol=1e-3, rtol=1e-3)
    assert (got - want).abs().max() < 0.05 * want.abs().max()  # 8-bit rounding, not another function
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
    h_BTD = torch.randn(2, 3, 64, generator=g)
    with torch.no_grad():
        a, b = packed.qkv_proj(h_BTD), float_head.qkv_proj(h_BTD)
    assert (a - b).abs().max() < 0.02 * b.abs().max()


@pytest.mark.model
def test_the_shipped_head_on_a_gguf_q8_target_runs_int8_products():
    from specdec.drafters.eagle.weights import load_packed_head
    from specdec.targets import load_target

    for weights in ("gguf-q8", "gguf"):
        target = load_target("smollm2-135m", weights=weights, load_tokenizer=False)
        head, _ = load_packed_head(target)
        int8 = weights == "gguf-q8" and head.lm_head.backend == "packed"
        assert head.lm_head.format == ("q8a8" if int8 else "bf16"), weights
        assert head.qkv_proj.format == ("q8" if int8 else "bf16") and head.fc.format == "bf16", weights


def _packed_products(head):
    """Every packed product of a head: fc, fc_aux, the layer's four and the LM head."""
    names = ("fc", "fc_aux", "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
    return [getattr(head, n) for n in names if getattr(head, n) is not None]


def test_bf16_packed_weights_are_the_default_on_the_packed_kernel_and_stay_close(tiny):
    """The drafter stores its packed weights in bf16 where the packed CPU kernel runs (activations
    stay float32); the layer's weights ship as bf16, so only fc's folded scales and the LM-head
    rows are rounded."""
    from specdec.drafters.eagle import EagleDrafter
    from specdec.targets.linear import resolve_backend

    drafter = EagleDrafter(tiny["target"], weights=str(tiny["weights"]))
    kernel = resolve_backend("auto", "cpu")
    want = "bf16" if kernel == "packed" else "f32"
    assert {lin.format for lin in _packed_products(drafter.head)} == {want}
    f32 = EagleDrafter(tiny["target"], weights=str(tiny["weights"]), weight_dtype="float32")
    assert {lin.format for lin in _packed_products(f32.head)} == {"f32"}
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(1, 6, 64, generator=g) * 3
    tokens = torch.randint(0, 259, (1, 6), generator=g)
    with torch.no_grad():
        outs = []
        for head in (f32.head, drafter.head):
            cache = EagleCache(head, 1, 8)
            slots = torch.arange(6).unsqueeze(0)
            f = cache.step(head, feats, tokens, slots, slots, torch.arange(6) <= slots.unsqueeze(-1))
            outs.append(head.logits(f))
    scale = outs[0].abs().max()
    assert (outs[1] - outs[0]).abs().max() < 0.02 * scale
    with pytest.raises(ValueError, match="weight_dtype"):
        EagleDrafter(tiny["target"], weights=str(tiny["weights"]), weight_dtype="float16")


@pytest.mark.parametrize("step", [2, 3])
def test_unrolled_training_step_equals_inference_drafting(tiny, step):
    """Training-time test step s at position t == the s-th draft at inference after true features ≤ t−s+1."""
    head, _ = load_eagle_head(tiny["weights"], tiny["parts"])
    g = torch.Generator().manual_seed(1)
    T = 10
    feats = torch.randn(1, T, 64, generator=g)
    next_tokens = torch.randint(0, 259, (1, T), generator=g)
    with torch.no_grad():
        preds = unrolled_features(head, feats, next_tokens, step)
        for m in range(0, T - step + 1):
            cache = EagleCache(head, 1, T)
            slots = torch.arange(m + 1).unsqueeze(0)
            out = cache.step(
                head,
                feats[:, : m + 1],
                next_tokens[:, : m + 1],
                slots,
                slots,
                torch.arange(m + 1) <= slots.unsqueeze(-1),
            )
            f = out[:, -1:]
            for r in range(2, step + 1):
                slot = torch.tensor([[m + r - 1]])
                f = cache.step(
                    head,
                    f,
                    next_tokens[:, m + r - 1 : m + r],
                    slot,
                    slot,
                    torch.arange(m + r) <= slot.unsqueeze(-1),
                )
            torch.testing.assert_close(f[0, 0], preds[step - 1][0, m + step - 1], atol=1e-5, rtol=1e-5)


def test_draft_distribution_equals_full_vocab_processing():
    g = torch.Generator().manual_seed(2)
    vocab = torch.sort(torch.randperm(50, generator=g)[:20]).values
    logits_N = torch.randn(3, 20, generator=g)
    logits_N[:, 3] = logits_N[:, 4]  # a tie
    full = torch.full((3, 50), float("-inf"))
    full[:, vocab] = logits_N
    for sp in [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.2, top_k=5, top_p=0.8),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=30),
    ]:
        want = logits_to_probs(full, sp.temperature, sp.top_k, sp.top_p)
        torch.testing.assert_close(draft_distribution(logits_N, vocab, 50, sp), want)


@pytest.mark.parametrize("drafter", ["eagle", "eagle-tree", "ngram-eagle", "ngram-eagle-tree"])
def test_greedy_equals_plain_decoding_ragged_batch(tiny, drafter):
    target, prompts = tiny["target"], _prompts()
    ref = specdec.generate(
        target, prompts, drafter="none", max_new_tokens=30, temperature=0.0, ignore_eos=True
    )
    out = _generate(tiny, prompts, drafter, max_new_tokens=30, temperature=0.0, gamma=4)
    assert out.token_ids == ref.token_ids
    assert out.metrics.num_accepted > 0  # the trained tiny head is right some of the time
    for b, p in enumerate(prompts):  # each row alone: same tokens
        single = _generate(tiny, [p], drafter, max_new_tokens=30, temperature=0.0, gamma=4)
        assert single.token_ids[0] == ref.token_ids[b]


@pytest.mark.parametrize(
    "drafter,options",
    [
        ("eagle", {"min_prob": 0.005}),
        ("ngram-eagle", {"min_prob": 0.005}),
        ("eagle-tree", {"tree_min_prob": 0.002}),
    ],
)
def test_confidence_stop_keeps_greedy_output_and_drafts_less(tiny, drafter, options):
    """The confidence stop (chain) and the tree's probability floor change only what is drafted.
    (The tiny head is unsure, its top probabilities ~1/200, hence the low thresholds.)"""
    prompts = _prompts()

    def run(rows, opts):
        return _generate(tiny, rows, drafter, opts, max_new_tokens=30, temperature=0.0, gamma=4)

    # Batched (the chain stops when every row is unsure) and one row (the dynamic tree's only case).
    for rows in (prompts, prompts[:1]) if drafter != "eagle-tree" else (prompts[:1],):
        ref, cut = run(rows, {}), run(rows, options)
        assert cut.token_ids == ref.token_ids
        assert cut.metrics.num_accepted > 0
        assert cut.metrics.num_proposed < ref.metrics.num_proposed
        assert cut.metrics.acceptance_rate > ref.metrics.acceptance_rate  # it drops the unlikely drafts


def test_batched_proposals_equal_single_row_proposals(tiny):
    """Row b's drafts among several requests, drafted in one call, are exactly its drafts when run
    alone."""
    target, prompts = tiny["target"], _prompts()
    log: list = []

    class Recording(EagleDrafter):
        def propose(self, call):
            p = super().propose(call)
            state, at = call.state, 0
            for i, count in enumerate(p.counts_B):
                n = int(state.lengths_B[i])
                prompt = tuple(state.tokens_BL[i, : int(state.prompt_lengths_B[i])].tolist())
                log.append((prompt, n, p.tokens_T[at : at + count].tolist()))
                at += count
            return p

    def run(rows):
        log.clear()
        specdec.generate(
            target,
            rows,
            drafter=Recording(target, num_slots=len(rows), weights=tiny["weights"]),
            max_new_tokens=30,
            temperature=0.0,
            gamma=3,
            ignore_eos=True,
        )
        return list(log)

    batched = run(prompts)
    assert len({prompt for prompt, _, _ in batched}) == len(prompts)  # every request drafted
    for p in prompts:
        alone = {n: drafts for _, n, drafts in run([p])}
        seen = 0
        for prompt, n, drafts in batched:
            if prompt == tuple(p) and n in alone:
                assert drafts == alone[n]
                seen += len(drafts) > 0
        assert seen > 3


def test_sampling_is_seeded_and_valid(tiny):
    prompts = _prompts()
    runs = [
        _generate(tiny, prompts, name, max_new_tokens=20, temperature=0.9, top_k=50, seed=4)
        for name in ("eagle", "eagle", "eagle-tree", "ngram-eagle", "ngram-eagle")
    ]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[3].token_ids == runs[4].token_ids
    assert all(len(r) == 20 for run in runs for r in run.token_ids)


def test_bad_input_raises_valueerror(tiny, tmp_path):
    target = tiny["target"]
    with pytest.raises(ValueError, match="no such file"):
        EagleDrafter(target, weights=tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="draft_vocab_size"):
        EagleDrafter(target, weights=tiny["weights"], draft_vocab_size=10_000)
    with pytest.raises(ValueError, match="FeatureTarget"):
        EagleDrafter(object(), weights=tiny["weights"])
    other = LlamaTarget.from_pretrained(save_tiny_checkpoint(tmp_path / "other", seed=9))
    with pytest.raises(ValueError, match="trained for target"):
        EagleDrafter(other, weights=tiny["weights"])
    hf_target = HFTarget(tiny["hf"])
    with pytest.raises(ValueError, match="copy_slots"):
        eagle_tree(hf_target, weights=tiny["weights"])
    with pytest.raises(ValueError, match="unknown tree preset"):
        eagle_tree(target, weights=tiny["weights"], tree="nope")
    with pytest.raises(ValueError, match="trees must be one of"):
        EagleDrafter(target, weights=tiny["weights"], trees="sometimes")
    with pytest.raises(ValueError, match="tree_width must be an int"):
        eagle_tree(target, weights=tiny["weights"], tree_width=0)


def test_hf_target_chain_matches(tiny):
    """The chain drafter also runs on the generic HF target (features via its hook)."""
    hf_target = HFTarget(tiny["hf"])
    prompts = _prompts()[:2]
    ref = specdec.generate(
        hf_target, prompts, drafter="none", max_new_tokens=12, temperature=0.0, ignore_eos=True
    )
    out = specdec.generate(
        hf_target,
        prompts,
        drafter="eagle",
        drafter_options={"weights": str(tiny["weights"])},
        max_new_tokens=12,
        temperature=0.0,
        ignore_eos=True,
    )
    assert out.token_ids == ref.token_ids


def test_smaller_draft_vocab_keeps_the_most_frequent(tiny):
    d = EagleDrafter(tiny["target"], weights=tiny["weights"], draft_vocab_size=50)
    from safetensors import safe_open

    with safe_open(str(tiny["weights"]), framework="pt") as f:
        stored = f.get_tensor("draft_vocab_N")
    assert d.head.draft_vocab_N.tolist() == sorted(stored[:50].tolist())
    assert d.head.lm_head.out_features == 50


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize(
    "drafter", ["eagle", "eagle-tree", "ngram-eagle", "ngram-eagle-tree", "ngram-eagle-auto"]
)
def test_smollm2_greedy_equals_transformers(drafter, smollm2_greedy):
    """Greedy output with the shipped head equals transformers' greedy generate, token for token."""
    from specdec.targets import load_target

    target = load_target("smollm2-135m", weights="gguf")  # the format equal to transformers
    prompts = smollm2_greedy.prompts()
    out = specdec.generate(
        target, prompts, drafter=drafter, max_new_tokens=N, temperature=0.0, gamma=5, ignore_eos=True
    )
    for p, got in zip(prompts, out.token_ids, strict=True):
        assert got == smollm2_greedy(p, N, stop_at_eos=False)
    assert out.metrics.mean_accepted_tokens > 1.5


@pytest.mark.model
def test_default_drafter_is_lookup_then_the_shipped_eagle_head_for_smollm2():
    """``default`` is one NGramEagleDrafter over one EAGLE drafter in ``auto`` trees: a greedy request
    alone in its steps drafts EAGLE-2's dynamic tree, a sampled one chains, from the same head and
    queued features; how deep it drafts is the engine's depth controller's choice."""
    from specdec.drafters.ngram import NGramDrafter
    from specdec.drafters.ngram_eagle import NGramEagleDrafter, default_drafter
    from specdec.targets import load_target

    target = load_target("smollm2-135m")
    drafter = default_drafter(target)
    assert isinstance(drafter, NGramEagleDrafter) and drafter.mode == "auto"
    assert isinstance(drafter.lookup, NGramDrafter) and drafter.eagle.tree_mode == "auto"
    assert drafter.eagle.trees.tree_min_prob == 0.05 and drafter.eagle.trees.dynamic
    assert drafter.eagle.min_prob == 0.2 and drafter.head is drafter.eagle.head
    ids = target.tokenizer("def add(a, b):").input_ids
    specdec.generate(target, [ids], drafter=drafter, max_new_tokens=8, temperature=0.0)
    trees = drafter.counts["tree"]
    assert trees > 0
    specdec.generate(target, [ids], drafter=drafter, max_new_tokens=8, temperature=0.7, seed=0)
    assert drafter.counts["tree"] == trees and drafter.counts["head"] > 0  # sampled: chains


def test_default_drafter_falls_back_for_other_targets(tiny, capsys):
    from specdec.drafters.ngram import NGramDrafter
    from specdec.drafters.ngram_eagle import default_drafter

    drafter = default_drafter(tiny["target"])
    assert isinstance(drafter, NGramDrafter)
    assert "drafter 'default' -> 'ngram'" in capsys.readouterr().err


class _CheckingEagle:
    """A slot drafter running a lookup-first drafter for one request; whenever it drafts with the
    head, a separately fed EAGLE drafter agrees."""

    def __init__(self, hybrid, reference):
        self.hybrid, self.reference, self.checked = hybrid, reference, 0
        self.num_slots, self.catch_up_s, self.catch_up_tokens = 1, 0.0, 0

    def add(self, slot, prompt_ids, prefill_out):
        self.hybrid.add(slot, prompt_ids, prefill_out)
        self.reference.add(slot, prompt_ids, prefill_out)

    def drop(self, slot):
        self.hybrid.drop(slot)
        self.reference.drop(slot)

    def observe(self, slots, num_accepted, features, *, state):
        self.hybrid.observe(slots, num_accepted, features, state=state)
        self.reference.observe(slots, num_accepted, features, state=state)

    def propose(self, call):
        heads = self.hybrid.counts["head"]
        p = self.hybrid.propose(call)
        if self.hybrid.counts["head"] > heads:
            ref = self.reference.propose(call)
            assert p.tokens_T.tolist() == ref.tokens_T.tolist()
            self.checked += 1
        else:
            self.reference.catch_up(list(call.slots), call.state, [0])
        return p


def test_ngram_eagle_uses_both_drafters_and_keeps_eagle_in_step(tiny):
    """Lookup steps still feed the head's cache: every head step drafts exactly what an EAGLE
    drafter fed every committed token would."""
    from specdec.drafters.ngram_eagle import NGramEagleDrafter

    target = tiny["target"]
    hybrid = NGramEagleDrafter(target, mode="chain", weights=tiny["weights"], min_prob=0.0, min_ngram=2)
    checking = _CheckingEagle(hybrid, EagleDrafter(target, weights=tiny["weights"]))
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # repeats: the lookup fires
    out = specdec.generate(target, [prompt], drafter=checking, max_new_tokens=40, temperature=0.0, gamma=3)
    assert (
        out.token_ids
        == specdec.generate(target, [prompt], drafter="none", max_new_tokens=40, temperature=0.0).token_ids
    )
    assert hybrid.counts["lookup"] > 0 and hybrid.counts["head"] > 0
    assert checking.checked == hybrid.counts["head"]
    with pytest.raises(ValueError, match="min_tokens"):
        NGramEagleDrafter(target, weights=tiny["weights"], min_tokens=0)
    with pytest.raises(ValueError, match="mode"):
        NGramEagleDrafter(target, weights=tiny["weights"], mode="both")


def test_ngram_eagle_auto_chains_equal_a_chain_drafters_where_trees_do_not_pay(tiny):
    """In ``auto`` mode a greedy row drafts chains at the steps where a tree does not pay, from the
    head cache and feature queue its trees use: every such chain equals what a separately fed chain
    drafter proposes."""
    from specdec.drafters.ngram_eagle import NGramEagleDrafter

    class NoTrees(_CheckingEagle):
        def propose(self, call):
            return super().propose(replace(call, tree_ok=False))

    target = tiny["target"]
    hybrid = NGramEagleDrafter(target, mode="auto", weights=tiny["weights"], min_prob=0.0, min_ngram=2)
    checking = NoTrees(hybrid, EagleDrafter(target, weights=tiny["weights"]))
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    kw = {"max_new_tokens": 40, "temperature": 0.0, "gamma": 3}
    out = specdec.generate(target, [prompt], drafter=checking, **kw)
    assert out.token_ids == specdec.generate(target, [prompt], drafter="none", **kw).token_ids
    assert hybrid.counts["tree"] == 0
    assert checking.checked == hybrid.counts["head"] > 0


def test_ngram_eagle_tree_mixes_lookup_chains_and_eagle_trees(tiny):
    target = tiny["target"]
    drafter = create_drafter("ngram-eagle-tree", target, **_options(tiny, "ngram-eagle-tree"))
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    kw = {"max_new_tokens": 40, "temperature": 0.0, "gamma": 3}
    out = specdec.generate(target, [prompt], drafter=drafter, **kw)
    assert out.token_ids == specdec.generate(target, [prompt], drafter="none", **kw).token_ids
    assert drafter.counts["lookup"] > 0 and drafter.counts["tree"] > 0 and drafter.counts["head"] == 0


def test_ngram_eagle_auto_drafts_the_tree_only_at_steps_where_the_engine_says_it_pays(tiny, monkeypatch):
    """In the engine a tree takes a forward of its own: ``auto`` drafts it only where the engine sets
    ``DecodeState.tree_ok`` (one decoding row, trees paying on the cost model), the chain at the
    other steps, and the output is plain decoding's either way."""
    from specdec.engine import Engine

    calls: list[tuple[str, bool]] = []
    propose = EagleDrafter.propose

    def spy(self, call):
        p = propose(self, call)
        if any(call.depths):
            calls.append(("tree" if p.tree is not None or p.trees else "chain", call.tree_ok))
        return p

    monkeypatch.setattr(EagleDrafter, "propose", spy)
    target, prompts = tiny["target"], _prompts()
    options = {"weights": str(tiny["weights"]), "tree_width": 3}

    def run(rows: list[list[int]], trees_pay: bool) -> list[list[int]]:
        engine = Engine(target, drafter="ngram-eagle-auto", drafter_options=options, gamma=3, max_num_seqs=3)
        engine.scheduler.tree_pays = trees_pay
        ids = [engine.add_request(p, max_new_tokens=16, temperature=0.0, ignore_eos=True) for p in rows]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        return [done[i] for i in ids]

    kw = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    plain = [specdec.generate(target, [p], drafter="none", **kw).token_ids[0] for p in prompts]
    assert run(prompts[:1], True) == plain[:1]
    assert calls and all(kind == "tree" and ok for kind, ok in calls)  # alone: every head draft a tree
    calls.clear()
    assert run(prompts[:1], False) == plain[:1]
    assert calls and all(kind == "chain" and not ok for kind, ok in calls)  # trees do not pay here
    calls.clear()
    assert run(prompts, True) == plain
    assert ("chain", False) in calls  # steps shared with other rows draft chains
    assert all(ok == (kind == "tree") for kind, ok in calls)


def test_ngram_eagle_auto_takes_the_tree_for_greedy_rows_only(tiny):
    """A greedy request alone in its steps takes the tree; a sampled one, or rows sharing a step,
    the chain; a target without tree attention never drafts trees."""
    target, prompts = tiny["target"], _prompts()
    drafter = create_drafter(
        "ngram-eagle-auto", target, num_slots=3, weights=str(tiny["weights"]), tree_width=3
    )
    assert drafter.eagle.trees.tree_width == 3
    kw = {"max_new_tokens": 20, "ignore_eos": True}
    for rows, temperature, trees in (
        (prompts[:1], 0.0, True),
        (prompts[:1], 0.8, False),
        (prompts, 0.8, False),
    ):
        before = drafter.counts["tree"]
        out = specdec.generate(target, rows, drafter=drafter, temperature=temperature, seed=1, **kw)
        ref = specdec.generate(target, rows, drafter="none", temperature=temperature, seed=1, **kw)
        assert (drafter.counts["tree"] > before) == trees
        if temperature == 0.0:
            assert out.token_ids == ref.token_ids
    on_hf = create_drafter("ngram-eagle-auto", HFTarget(tiny["hf"]), weights=str(tiny["weights"]))
    specdec.generate(HFTarget(tiny["hf"]), prompts[:1], drafter=on_hf, temperature=0.0, max_new_tokens=4)
    assert on_hf.eagle.tree_mode == "never" and on_hf.counts["tree"] == 0  # no tree attention in HF
    with pytest.raises(ValueError, match="hold no request"):
        one = DecodeState(torch.tensor([[1, 2]]), torch.tensor([1]), torch.tensor([2]), torch.tensor([False]))
        drafter.propose(DraftCall([0], [2], one, [SamplingParams()]))
