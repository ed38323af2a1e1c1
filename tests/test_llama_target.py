"""The native Llama-family target against ``transformers``: logits, cache, ragged rows, trees, greedy output.

Legend: B batch, T block length, V vocabulary.

Tiny random-init checkpoints of every native family (Llama with tied embeddings and biases,
Mistral, Qwen2 with q/k/v biases, Qwen3 with q/k norms and a head_dim that is not hidden/heads)
are saved as safetensors and loaded by ``LlamaTarget``; every block's logits must match the
``transformers`` model run over the whole sequence at once (fp32, 1e-4).
"""

from __future__ import annotations

import json

import pytest
import torch
from _reference import SMOLLM2_NEW_TOKENS as N
from _tiny import tiny_config_fields

from specdec.protocols import Target
from specdec.targets.linear import LINEAR_BACKENDS, PackedLinear
from specdec.targets.llama import LlamaTarget

ATOL = 1e-4
VOCAB = 96


def _tiny_config(family: str):
    import transformers

    common = tiny_config_fields(vocab_size=VOCAB, num_hidden_layers=3, eos_token_id=3)
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_theta=100000.0),
        "llama_bias": lambda: transformers.LlamaConfig(
            **common,
            attention_bias=True,
            mlp_bias=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        "mistral": lambda: transformers.MistralConfig(**common, sliding_window=128),
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "qwen3": lambda: transformers.Qwen3Config(
            **{**common, "num_attention_heads": 2, "num_key_value_heads": 1}, head_dim=48
        ),
    }
    return configs[family]()


def _model_class(config):
    import transformers

    return {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
    }[config.model_type]


FAMILIES = ["llama", "llama_bias", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``family -> (hf_model, checkpoint_dir)`` for every tiny family."""
    out = {}
    for i, family in enumerate(FAMILIES):
        config = _tiny_config(family)
        torch.manual_seed(i)
        model = _model_class(config)(config).float().eval()
        if family == "llama_bias":  # default init zeroes biases; make them matter
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("bias"):
                        p.normal_(0, 0.1)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path, safe_serialization=True)
        out[family] = (model, path)
    return out


def _reference_logits(model, ids_T: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids_T])).logits[0].float()


def _load(path, **kw) -> LlamaTarget:
    return LlamaTarget.from_pretrained(path, load_tokenizer=False, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_decode_blocks_and_rollback_match_transformers(checkpoints, family):
    model, path = checkpoints[family]
    target = _load(path)
    assert isinstance(target, Target)
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    ref = _reference_logits(model, seq)
    target.reset(1, 64)

    out = target.forward(torch.tensor([seq[:17]]), torch.tensor([0]))
    torch.testing.assert_close(out.logits_BTV[0], ref[:17], atol=ATOL, rtol=0)
    assert out.hidden_BTD.shape == (1, 17, 64)
    pos = 17
    for T in (1, 4, 1, 3, 1, 1, 5):  # decode steps and verify-sized blocks
        out = target.forward(torch.tensor([seq[pos : pos + T]]), torch.tensor([pos]))
        torch.testing.assert_close(out.logits_BTV[0], ref[pos : pos + T], atol=ATOL, rtol=0)
        pos += T

    # Speculate 6 wrong tokens, keep 2 of them, roll back, continue with a different sequence.
    wrong = torch.randint(0, VOCAB, (6,), generator=g).tolist()
    target.forward(torch.tensor([wrong]), torch.tensor([pos]))
    assert target.cache.lengths_B.tolist() == [pos + 6]
    target.rollback(torch.tensor([pos + 2]))
    new_seq = seq[:pos] + wrong[:2] + torch.randint(0, VOCAB, (5,), generator=g).tolist()
    ref2 = _reference_logits(model, new_seq)
    out = target.forward(torch.tensor([new_seq[pos + 2 :]]), torch.tensor([pos + 2]))
    torch.testing.assert_close(out.logits_BTV[0], ref2[pos + 2 :], atol=ATOL, rtol=0)


def test_hidden_states_are_last_layer_before_final_norm(checkpoints):
    model, path = checkpoints["llama"]
    target = _load(path)
    captured = {}
    hook = model.model.norm.register_forward_pre_hook(lambda m, args: captured.setdefault("h", args[0]))
    seq = list(range(5, 25))
    with torch.no_grad():
        model(torch.tensor([seq]))
    hook.remove()
    target.reset(1, 32)
    out = target.forward(torch.tensor([seq]), torch.tensor([0]))
    torch.testing.assert_close(out.hidden_BTD, captured["h"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_ragged_batch_and_logits_index(checkpoints, family):
    """Three rows of different prompt lengths, right-padded prefill, then blocks at different starts."""
    model, path = checkpoints[family]
    target = _load(path)
    g = torch.Generator().manual_seed(2)
    lengths = [5, 12, 9]
    seqs = [torch.randint(0, VOCAB, (30,), generator=g).tolist() for _ in lengths]
    refs = [_reference_logits(model, s) for s in seqs]
    target.reset(3, 48)
    width = max(lengths)
    prefill = torch.tensor([s[:n] + [0] * (width - n) for s, n in zip(seqs, lengths, strict=True)])
    last = torch.tensor(lengths) - 1
    out = target.forward(prefill, torch.zeros(3, dtype=torch.long), logits_index_BN=last[:, None])
    assert out.logits_BTV.shape == (3, 1, VOCAB)
    for b in range(3):
        torch.testing.assert_close(out.logits_BTV[b, 0], refs[b][lengths[b] - 1], atol=ATOL, rtol=0)
    target.rollback(torch.tensor(lengths))

    pos = list(lengths)
    for step_T, advance in [(1, [1, 1, 1]), (4, [2, 4, 1]), (3, [3, 0, 2]), (1, [1, 1, 1])]:
        block = torch.tensor([s[p : p + step_T] for s, p in zip(seqs, pos, strict=True)])
        out = target.forward(block, torch.tensor(pos))
        for b in range(3):
            torch.testing.assert_close(
                out.logits_BTV[b], refs[b][pos[b] : pos[b] + step_T], atol=ATOL, rtol=0
            )
        pos = [p + a for p, a in zip(pos, advance, strict=True)]  # ragged acceptance
        target.rollback(torch.tensor(pos))


@pytest.mark.parametrize("backend", sorted(LINEAR_BACKENDS))
def test_linear_backends_agree(checkpoints, backend):
    model, path = checkpoints["llama_bias"]
    target = _load(path, linear_backend=backend)
    seq = list(range(3, 23))
    target.reset(1, 32)
    out = target.forward(torch.tensor([seq]), torch.tensor([0]))
    torch.testing.assert_close(out.logits_BTV[0], _reference_logits(model, seq), atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", ["plain", "bias+residual", "norm", "swiglu"])
def test_linear_backends_match_reference_on_odd_shapes(dtype, fused):
    """Every backend against the F.linear reference: ragged output blocks (O % 32 != 0), M = 1..30 rows."""
    g = torch.Generator().manual_seed(7)
    O, I = 37, 19
    w = torch.randn(O, I, generator=g)
    kw = {}
    bias = torch.randn(O, generator=g) if fused == "bias+residual" else None
    if fused == "norm":
        kw = {"norm_weight_I": torch.rand(I, generator=g) + 0.5, "norm_eps": 1e-5}
    if fused == "swiglu":
        kw = {"swiglu": True}
    width = 2 * I if fused == "swiglu" else I
    ref = PackedLinear(w, bias, backend="reference", dtype=dtype, **kw)
    for backend in sorted(LINEAR_BACKENDS):
        lin = PackedLinear(w, bias, backend=backend, dtype=dtype, **kw)
        for M in (1, 2, 5, 12, 13, 30):
            x = torch.randn(M, width, generator=g)
            residual = torch.randn(M, O, generator=g) if fused == "bias+residual" else None
            out, expected = lin(x, residual), ref(x, residual)
            assert out.shape == (M, O) and out.dtype == torch.float32
            # bf16: the reference rounds activations to bf16 too, the packed kernel keeps them fp32.
            tol = 1e-4 if dtype == torch.float32 else 0.05 * float(expected.abs().max())
            torch.testing.assert_close(out, expected, atol=tol, rtol=0, msg=f"{backend} M={M}")


def _tree():
    """A 6-token tree: 0 → {1, 2}; 1 → {3, 4}; 2 → {5}. Returns (parents, tree_mask_TT, depth_T)."""
    parents = [-1, 0, 0, 1, 1, 2]
    T = len(parents)
    mask = torch.zeros(T, T, dtype=torch.bool)
    depth = torch.zeros(T, dtype=torch.long)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
    return parents, mask, depth


def _branch(parents, leaf):
    path = [leaf]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def test_tree_attention_chain_and_branches(checkpoints):
    model, path = checkpoints["qwen3"]
    target = _load(path)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (11,), generator=g).tolist()
    block = torch.randint(0, VOCAB, (6,), generator=g).tolist()

    # A chain expressed as a tree mask equals the plain causal forward.
    target.reset(2, 32)
    prefill = torch.tensor([prompt, prompt])
    target.forward(prefill, torch.zeros(2, dtype=torch.long))
    chain = target.forward(torch.tensor([block, block]), torch.tensor([11, 11]))
    target.rollback(torch.tensor([11, 11]))
    as_tree = target.forward(
        torch.tensor([block, block]),
        torch.tensor([11, 11]),
        tree_mask_TT=torch.ones(6, 6, dtype=torch.bool).tril(),
        depth_T=torch.arange(6),
    )
    torch.testing.assert_close(as_tree.logits_BTV, chain.logits_BTV, atol=1e-6, rtol=0)

    # Every branch of a tree: its tokens' logits equal running the branch alone as a chain.
    parents, mask, depth = _tree()
    target.reset(1, 32)
    target.forward(torch.tensor([prompt]), torch.tensor([0]))
    tree_out = target.forward(torch.tensor([block]), torch.tensor([11]), tree_mask_TT=mask, depth_T=depth)
    for leaf in (3, 4, 5):
        nodes = _branch(parents, leaf)
        ref = _reference_logits(model, prompt + [block[i] for i in nodes])
        torch.testing.assert_close(tree_out.logits_BTV[0, nodes], ref[11:], atol=ATOL, rtol=0)


def test_copy_slots_after_tree_then_continue(checkpoints):
    """Accept the path 0 → 1 → 4 of a tree in row 0 and 0 → 2 → 5 in row 1, compact, keep decoding."""
    model, path = checkpoints["llama"]
    target = _load(path)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (9,), generator=g).tolist() for _ in range(2)]
    blocks = [torch.randint(0, VOCAB, (6,), generator=g).tolist() for _ in range(2)]
    parents, mask, depth = _tree()
    accepted = [[0, 1, 4], [0, 2]]  # ragged: row 1 keeps a shorter path
    starts = [9, 7]  # row 1's prompt is shorter
    target.reset(2, 40)
    target.forward(torch.tensor([prompts[0], prompts[1][:7] + [0, 0]]), torch.zeros(2, dtype=torch.long))
    target.rollback(torch.tensor(starts))
    target.forward(torch.tensor(blocks), torch.tensor(starts), tree_mask_TT=mask, depth_T=depth)
    # Pad row 1's path with any slot: entries past its new length are never read.
    src = torch.tensor(
        [[starts[0] + i for i in accepted[0]], [starts[1] + i for i in accepted[1]] + [starts[1]]]
    )
    target.copy_slots(src, torch.tensor(starts))
    new_len = [starts[b] + len(accepted[b]) for b in range(2)]
    target.rollback(torch.tensor(new_len))

    seqs = [
        prompts[0] + [blocks[0][i] for i in accepted[0]],
        prompts[1][:7] + [blocks[1][i] for i in accepted[1]],
    ]
    tails = [torch.randint(0, VOCAB, (4,), generator=g).tolist() for _ in range(2)]
    out = target.forward(torch.tensor(tails), torch.tensor(new_len))
    for b in range(2):
        ref = _reference_logits(model, seqs[b] + tails[b])
        torch.testing.assert_close(out.logits_BTV[b], ref[new_len[b] :], atol=ATOL, rtol=0)


def test_bfloat16_is_an_opt_in_that_stays_close(checkpoints):
    model, path = checkpoints["llama"]
    target = _load(path, dtype=torch.bfloat16)
    seq = list(range(10, 30))
    target.reset(1, 32)
    out = target.forward(torch.tensor([seq]), torch.tensor([0]))
    assert out.logits_BTV.dtype == torch.float32
    ref = _reference_logits(model, seq)
    assert (out.logits_BTV[0] - ref).abs().max() < 0.1
    assert (out.logits_BTV[0].argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_bad_input_raises(checkpoints, tmp_path):
    _, path = checkpoints["mistral"]
    target = _load(path)
    with pytest.raises(ValueError, match="reset"):
        target.forward(torch.tensor([[1]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="sliding_window"):
        target.reset(1, 200)
    target.reset(2, 16)
    with pytest.raises(ValueError, match="tokens_BT"):
        target.forward(torch.tensor([[1, 2]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="max_len"):
        target.forward(torch.tensor([[1] * 4] * 2), torch.tensor([0, 14]))
    with pytest.raises(ValueError, match="past the cached lengths"):
        target.forward(torch.tensor([[1], [2]]), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"\[0, 96\)"):
        target.forward(torch.tensor([[1], [VOCAB]]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="diagonal"):
        target.forward(
            torch.tensor([[1, 2]] * 2), torch.tensor([0, 0]), tree_mask_TT=torch.zeros(2, 2, dtype=torch.bool)
        )
    target.forward(torch.tensor([[1, 2]] * 2), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="lengths_B"):
        target.rollback(torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="linear backend"):
        _load(path, linear_backend="nope")

    # Configurations the native target does not implement are refused, not run differently.
    cfg = json.loads((path / "config.json").read_text())
    for change, message in [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "gemma"}, "model_type|gemma"),
    ]:
        bad = tmp_path / f"bad{len(message)}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**cfg, **change}))
        (bad / "model.safetensors").symlink_to(path / "model.safetensors")
        with pytest.raises(ValueError, match=message):
            _load(bad)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="safetensors"):
        _load(pickled)


# --- the real model -------------------------------------------------------------------------------


def _greedy(target: LlamaTarget, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """A minimal greedy decode loop over the Target protocol (ragged prompts, one token per step)."""
    B = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    target.reset(B, int(lengths.max()) + max_new + 1)
    width = int(lengths.max())
    padded = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    out = target.forward(padded, torch.zeros(B, dtype=torch.long), logits_index_BN=(lengths - 1)[:, None])
    target.rollback(lengths)
    generated = [[] for _ in range(B)]
    tok_B = out.logits_BTV[:, -1].argmax(-1)
    for step in range(max_new):
        for b in range(B):
            generated[b].append(int(tok_B[b]))
        if step == max_new - 1:
            break
        out = target.forward(tok_B[:, None], lengths + step)
        tok_B = out.logits_BTV[:, -1].argmax(-1)
    return generated


@pytest.mark.model
def test_smollm2_greedy_equals_transformers_generate(smollm2_greedy):
    target = LlamaTarget.from_pretrained("smollm2-135m", weights="gguf")  # the format equal to transformers
    assert target.eos_token_ids == (2,)
    prompts = smollm2_greedy.prompts()
    ours_batch = _greedy(target, prompts, N)  # ragged batch of 3
    for b, ids in enumerate(prompts):
        ref = smollm2_greedy(ids, N)
        assert len(ref) == N, "pick prompts whose greedy continuation does not stop early"
        assert _greedy(target, [ids], N)[0] == ref, f"prompt {b}"
        assert ours_batch[b] == ref, f"prompt {b} in the ragged batch"


def test_load_target_dispatches_on_the_one_list_of_native_families(tmp_path):
    """``auto`` picks the native target for every family in NATIVE_FAMILIES (the only list)."""
    from _tiny import save_tiny_checkpoint

    from specdec.targets import load_target
    from specdec.targets.hf import HFTarget

    path = save_tiny_checkpoint(tmp_path / "tiny")
    assert isinstance(load_target(path), LlamaTarget)
    assert isinstance(load_target(path, backend="hf"), HFTarget)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable checkpoint config.json"):
        load_target(path)


def test_flipped_rope_is_the_same_floats_as_rotate_half():
    """apply_rope_flipped (the target's and the EAGLE head's hot path) equals apply_rope exactly."""
    from specdec.targets.rope import apply_rope, apply_rope_flipped, flip_sin, rope_cos_sin_table

    g = torch.Generator().manual_seed(0)
    x_BHTD = torch.randn(2, 3, 5, 8, generator=g)
    cos_PD, sin_PD = rope_cos_sin_table(1.0 / 100.0 ** (torch.arange(0, 8, 2).float() / 8), 5)
    want = apply_rope(x_BHTD, cos_PD.expand(2, -1, -1), sin_PD.expand(2, -1, -1))
    got = apply_rope_flipped(x_BHTD, cos_PD, flip_sin(sin_PD))
    assert torch.equal(got, want)
    assert not torch.equal(apply_rope_flipped(x_BHTD, cos_PD, sin_PD), want)  # the sign flip matters
