"""EAGLE-3 heads (fused low/middle/last-layer features, token loss only) on a tiny random Llama:
the targets' layer capture, the fused input on every path (module, packed, chain, tree, lookup
mix), the training loss, and the data cache's layer features.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from _tiny import (
    byte_tokenizer,
    fit_tiny_head,
    greedy_training_block,
    save_tiny_checkpoint,
    tiny_llama,
    token_data,
)

import specdec
from specdec.drafters.eagle import (
    EagleConfig,
    EagleDrafter,
    EagleHead,
    PackedEagleHead,
    load_eagle_head,
)
from specdec.drafters.eagle.train.config import DataConfig, TrainConfig
from specdec.drafters.eagle.train.dataset import aux_shard_name, build_aux_features, load_dataset
from specdec.drafters.eagle.train.features import extract_features, extract_layer_features
from specdec.drafters.eagle.train.objective import Batches
from specdec.drafters.eagle.train.sources import Prompt, repeat_sequences
from specdec.protocols import TargetOutput
from specdec.targets.hf import HFTarget
from specdec.targets.llama import LlamaTarget

AUX = (0, 1)  # of the tiny target's 3 layers: the last one is the usual feature


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    """A 3-layer tiny target and an EAGLE-3 head trained (token loss only) on its continuations."""
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny3"), seed=4, num_layers=3)
    target = LlamaTarget.from_pretrained(path)
    hf = tiny_llama(seed=4, num_layers=3)
    parts = target.parts()
    target.capture_layers(AUX)
    seqs, out = greedy_training_block(hf, target)
    aux_BTAD = torch.stack([out.aux_hidden_BTD[i] for i in AUX], dim=2)
    rms_A = aux_BTAD.pow(2).mean(-1).sqrt().flatten(0, 1).median(0).values
    cfg = TrainConfig(unroll=2, feature_noise=0.0, reg_weight=0.0, ce_weight=1.0, aux_layers=AUX)
    weights = tmp_path_factory.mktemp("head3") / "head3.safetensors"
    head = {"aux_layers": AUX, "aux_scales": tuple(1 / float(r) for r in rms_A)}
    history = fit_tiny_head(
        hf, parts, seqs, out, cfg, weights, target_name="tiny3", aux_BTAD=aux_BTAD, seed=0, **head
    )
    return {"path": path, "target": target, "hf": hf, "weights": weights, "history": history, "parts": parts}


def _prompts():
    g = torch.Generator().manual_seed(6)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 9, 3)]


def test_targets_return_the_captured_layers_outputs(tiny3):
    """Native and HF targets both return exactly the outputs of the layers asked for."""
    tokens = torch.tensor([[3, 50, 7, 99, 12], [8, 8, 1, 200, 4]])
    with torch.inference_mode():
        hs = tiny3["hf"](input_ids=tokens, output_hidden_states=True).hidden_states  # hs[i+1]: layer i
        native = tiny3["target"]
        native.reset(2, 16)
        out = native.forward(tokens, torch.zeros(2, dtype=torch.long))
        hf_target = HFTarget(tiny3["hf"])
        hf_target.reset(2, 16)  # no capture asked for yet: no aux outputs
        assert hf_target.forward(tokens, torch.zeros(2, dtype=torch.long)).aux_hidden_BTD is None
        hf_target.capture_layers([1])
        hf_target.capture_layers([0, 1])  # requests add up; repeats are harmless
        hf_target.reset(2, 16)
        hf_out = hf_target.forward(tokens, torch.zeros(2, dtype=torch.long))
    for got in (out.aux_hidden_BTD, hf_out.aux_hidden_BTD):
        assert sorted(got) == [0, 1]
        for i in AUX:
            torch.testing.assert_close(got[i], hs[i + 1], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="layers"):
        native.capture_layers([3])
    with pytest.raises(ValueError, match="layers"):
        hf_target.capture_layers([-1])


def test_token_loss_training_learns_and_skips_the_regression(tiny3):
    h = tiny3["history"]
    assert h[0]["acc1"] < 0.1 and min(x["acc1"] for x in h[-10:]) > 0.3
    assert all(x["reg1"] == 0.0 for x in h)  # reg_weight 0: no feature regression at all


def test_packed_projection_equals_the_module(tiny3):
    ref, _ = load_eagle_head(tiny3["weights"], tiny3["parts"])
    fast = PackedEagleHead(ref, backend="reference")
    g = torch.Generator().manual_seed(0)
    f = torch.randn(2, 5, 64, generator=g) * 3
    aux = torch.randn(2, 5, 2, 64, generator=g)
    with torch.no_grad():
        want = ref.project(f, aux)
        torch.testing.assert_close(fast.project(f, aux), want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(want, f)  # it does fuse
    with pytest.raises(ValueError, match="aux_BTAD"):
        ref.project(f, aux[:, :, :1])
    with pytest.raises(ValueError, match="aux_BTAD"):
        ref.project(f)


@pytest.mark.parametrize("drafter", ["eagle", "eagle-tree", "ngram-eagle"])
def test_greedy_equals_plain_decoding_with_the_fused_head(tiny3, drafter):
    target, prompts = tiny3["target"], _prompts()
    ref = specdec.generate(
        target, prompts, drafter="none", max_new_tokens=30, temperature=0.0, ignore_eos=True
    )
    options = {"weights": str(tiny3["weights"]), **({"min_prob": 0.0} if drafter == "ngram-eagle" else {})}
    out = specdec.generate(
        target,
        prompts,
        drafter=drafter,
        drafter_options=options,
        max_new_tokens=30,
        temperature=0.0,
        gamma=4,
        ignore_eos=True,
    )
    assert out.token_ids == ref.token_ids
    assert out.metrics.num_accepted > 0


def test_fused_head_runs_on_the_hf_target(tiny3):
    """Same tokens and the same acceptances on the generic HF target (layers via its hooks)."""
    runs = [
        specdec.generate(
            t,
            _prompts(),
            drafter="eagle",
            drafter_options={"weights": str(tiny3["weights"])},
            max_new_tokens=30,
            temperature=0.0,
            gamma=4,
            ignore_eos=True,
        )
        for t in (tiny3["target"], HFTarget(tiny3["hf"]))
    ]
    assert runs[1].token_ids == runs[0].token_ids
    assert runs[1].metrics.accepted_at_position == runs[0].metrics.accepted_at_position
    assert runs[1].metrics.num_accepted > 0


def test_missing_layer_features_are_a_clear_error(tiny3):
    class NoCapture:  # exposes the head's target tensors but cannot capture layers
        vocab_size, eos_token_ids = 259, ()
        parts = tiny3["target"].parts
        reset = forward = rollback = tiny3["target"].reset

    with pytest.raises(ValueError, match="capture_layers"):
        EagleDrafter(NoCapture(), weights=tiny3["weights"])
    d = EagleDrafter(tiny3["target"], weights=tiny3["weights"])
    with pytest.raises(ValueError, match="aux_hidden_BTD"):
        d.input_features(TargetOutput(logits_BTV=torch.zeros(1, 2, 259), hidden_BTD=torch.zeros(1, 2, 64)))


def test_config_checks_aux_scales():
    base = dict(
        hidden_size=8,
        intermediate_size=16,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        vocab_size=10,
        draft_vocab_size=5,
    )
    with pytest.raises(ValueError, match="aux_scales"):
        EagleConfig(**base, aux_layers=(0, 1), aux_scales=(1.0,))
    with pytest.raises(ValueError, match="aux_layers"):
        EagleConfig(**base, aux_layers=(-1,), aux_scales=(1.0,))
    c = EagleConfig(**base, aux_layers=[0, 2], aux_scales=[0.5, 2])  # as read back from JSON
    assert c.aux_layers == (0, 2) and c.aux_scales == (0.5, 2.0)
    assert EagleHead(c).fc_aux.weight.shape == (8, 24)
    assert EagleHead(EagleConfig(**base)).fc_aux is None


def test_layer_features_extend_a_cache_and_batches_carry_them(tiny3, tmp_path):
    """extract_layer_features equals transformers' hidden states; build_aux_features adds them to
    a cache beside each shard (resumable), load_dataset and Batches carry them."""
    from safetensors.torch import save_file

    hf = tiny3["hf"]
    seqs = [[3, 4, 5, 6, 7, 8], [9, 10, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    got = extract_layer_features(hf, seqs, AUX, max_batch_tokens=12)
    for s, g in zip(seqs, got, strict=True):
        with torch.inference_mode():
            hs = hf(input_ids=torch.tensor([s]), output_hidden_states=True).hidden_states
        assert g.shape == (len(s), 2, 64) and g.dtype == torch.float16
        torch.testing.assert_close(g.float(), torch.stack([hs[1][0], hs[2][0]], 1), atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="layers"):
        extract_layer_features(hf, seqs, (5,))

    cache = tmp_path / "data"
    (cache / "shards").mkdir(parents=True)
    n = sum(map(len, seqs))
    save_file(
        {
            "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
            "features": torch.zeros(n, 64, dtype=torch.float16),
            "topk_ids": torch.zeros(n, 4, dtype=torch.int32),
            "topk_probs": torch.zeros(n, 4, dtype=torch.float16),
            "lengths": torch.tensor([len(s) for s in seqs]),
            "heldout": torch.tensor([False, True, False]),
        },
        str(cache / "shards" / "a.safetensors"),
        metadata={"names": json.dumps(["x", "y", "z"])},
    )
    (cache / "manifest.json").write_text(json.dumps({"shards": ["shards/a.safetensors"], "complete": True}))
    (cache / "config.json").write_text(json.dumps({"target": str(tiny3["path"])}))
    with pytest.raises(ValueError, match="build_aux_features"):
        load_dataset(cache, AUX)
    build_aux_features(cache, AUX, log=lambda s: None)
    aux_file = cache / aux_shard_name("shards/a.safetensors", AUX)
    assert aux_file.name == "a-aux-l0-l1.safetensors"
    stamp = aux_file.stat().st_mtime_ns
    build_aux_features(cache, AUX, log=lambda s: None)  # done already: nothing rewritten
    assert aux_file.stat().st_mtime_ns == stamp
    data = load_dataset(cache, AUX)
    assert data.aux.shape == (n, 2, 64)
    torch.testing.assert_close(data.aux[6:9], got[1])
    assert load_dataset(cache).aux is None
    b = Batches(data, data.sequences(False), seq_len=8, batch_size=3, seed=0).batch(0)
    assert b["aux"].shape[:2] == b["features"].shape[:2] and b["aux"].shape[2:] == (2, 64)


def _tiny_build(monkeypatch, tiny3, prompts, *, tokenizer):
    """Point build_dataset at the tiny target and ``prompts`` (continued 3 greedy tokens, no other
    source); returns that DataConfig."""
    import specdec.drafters.eagle.train.dataset as dd
    import specdec.targets as targets_pkg
    import specdec.targets.loading as loading

    monkeypatch.setattr(dd, "load_prompts", lambda tok: prompts)
    monkeypatch.setattr(loading, "load_tokenizer", lambda name: tokenizer)
    monkeypatch.setattr(loading, "load_hf_model", lambda name: tiny3["hf"])
    monkeypatch.setattr(targets_pkg, "load_target", lambda name: LlamaTarget.from_pretrained(tiny3["path"]))
    return DataConfig(
        target=str(tiny3["path"]),
        greedy_tokens=3,
        sample_tokens=0,
        function_prompts=0,
        self_instruct=0,
        text_tokens=0,
        repeat_sequences=0,
        topk=4,
    )


@pytest.mark.slow
def test_build_dataset_writes_layer_features_from_the_feature_pass(tiny3, tmp_path, monkeypatch):
    """build_dataset(aux_layers=...) writes each new shard's layer features from the same forward as
    its features: bit for bit what build_aux_features adds in a second pass to a cache built
    without them (two shards, held-out prompts included), and that pass then has nothing to do."""
    from safetensors.torch import load_file

    import specdec.drafters.eagle.train.dataset as dd

    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(4, 20, (70,), generator=gen).tolist()
    prompts = [
        Prompt(f"p{i}", "humaneval", i % 4 == 0, tuple(torch.randint(3, 250, (n,), generator=gen).tolist()))
        for i, n in enumerate(lengths)
    ]
    cfg = _tiny_build(monkeypatch, tiny3, prompts, tokenizer=None)
    quiet = lambda s: None  # noqa: E731
    one_pass = dd.build_dataset(cfg, tmp_path / "a", log=quiet, aux_layers=AUX)
    two_pass = dd.build_dataset(cfg, tmp_path / "b", log=quiet)
    shards = json.loads((one_pass / "manifest.json").read_text())["shards"]
    assert len(shards) == 2 and shards == json.loads((two_pass / "manifest.json").read_text())["shards"]
    assert not (two_pass / aux_shard_name(shards[0], AUX)).exists()
    dd.build_aux_features(two_pass, AUX, log=quiet)
    for shard in shards:
        a, b = (load_file(str(root / aux_shard_name(shard, AUX)))["aux"] for root in (one_pass, two_pass))
        assert a.dtype == torch.float16 and a.shape[1:] == (2, 64)
        assert torch.equal(a, b)
        assert torch.equal(
            load_file(str(one_pass / shard))["features"], load_file(str(two_pass / shard))["features"]
        )
    stamps = [(one_pass / aux_shard_name(s, AUX)).stat().st_mtime_ns for s in shards]
    dd.build_aux_features(one_pass, AUX, log=lambda s: pytest.fail(f"nothing should be left to do: {s}"))
    assert stamps == [(one_pass / aux_shard_name(s, AUX)).stat().st_mtime_ns for s in shards]
    assert torch.equal(dd.load_dataset(one_pass, AUX).aux, dd.load_dataset(two_pass, AUX).aux)


def test_extract_features_checks_its_aux_layers(tiny3):
    with pytest.raises(ValueError, match="layers"):
        extract_features(tiny3["hf"], [[3, 4, 5]], topk=4, aux_layers=(3,))
    feats, ids, probs, aux = extract_features(tiny3["hf"], [[3, 4, 5]], topk=4)
    assert aux is None and feats[0].shape == (3, 64) and ids[0].shape == probs[0].shape == (3, 4)


def test_copy_lessons_come_after_the_natural_sequences_and_reuse_their_shards(tiny3, tmp_path, monkeypatch):
    """A config that adds copy lessons keeps every natural sequence in its order, appends the lessons
    (built from the natural training sequences, all training data), and reuses the natural shards:
    only the shard that now holds lessons is extracted."""
    import specdec.drafters.eagle.train.dataset as dd

    tok = byte_tokenizer()
    rng = torch.Generator().manual_seed(2)
    words = "the plot was terrible and a cast of old friends could not save it".split()
    prompts = []
    for i in range(70):
        picks = torch.randint(len(words), (8,), generator=rng).tolist()
        text = f"p{i}: " + " ".join(words[j] for j in picks)
        prompts.append(Prompt(f"p{i}", "humaneval", i % 4 == 0, tuple(tok(text).input_ids)))
    cfg = _tiny_build(monkeypatch, tiny3, prompts, tokenizer=tok)
    quiet = lambda s: None  # noqa: E731
    plain = dd.load_dataset(dd.build_dataset(cfg, tmp_path, log=quiet))
    lines: list[str] = []
    with_lessons_dir = dd.build_dataset(
        replace(cfg, repeat_sequences=4, repeat_length=48), tmp_path, log=lines.append
    )
    assert with_lessons_dir != tmp_path / f"{dd.target_cache_name(cfg.target)}-{cfg.key()}"
    assert "[data] 1 of 2 shards were already in" in " ".join(lines)  # the full natural shard
    data = dd.load_dataset(with_lessons_dir)
    n = len(plain.names)
    assert data.names[:n] == plain.names and data.names[n:] == [f"repeat/{i}" for i in range(4)]
    assert not data.heldout[n:].any()
    assert torch.equal(data.tokens[: int(plain.offsets[n])], plain.tokens)
    spans = zip(plain.offsets[:-1].tolist(), plain.offsets[1:].tolist(), strict=True)
    natural = [
        (name, bool(held), plain.tokens[a:b].tolist())
        for name, held, (a, b) in zip(plain.names, plain.heldout, spans, strict=True)
    ]
    lessons = repeat_sequences(tok, natural, 4, length=48, seed=0)
    assert data.tokens[int(plain.offsets[n]) :].tolist() == [t for _, _, ids in lessons for t in ids]


def test_copy_agreement_scores_every_fresh_lesson_once(tiny3):
    """copy-agreement's lessons split: each of N fresh lessons is one window, scored once
    (batches=None), and Batches.take builds what batch() builds for the same windows."""
    from experiments import copy_agreement as ca
    from specdec.drafters.eagle.train.objective import Batches

    tok = byte_tokenizer()
    texts = [f"Item {i:02d}: the plot was terrible and the cast could not save it." for i in range(6)]
    seqs = [tok(t).input_ids for t in texts]
    natural = token_data(seqs, [f"s/{i}" for i in range(len(seqs))], [False] * len(seqs), dim=64)
    lessons = ca.lesson_data(tiny3["hf"], tok, natural, 11, aux_layers=AUX)
    head, _ = load_eagle_head(str(tiny3["weights"]), tiny3["parts"])
    once = ca.copy_agreement(head, lessons, lessons.sequences(True), batches=None)
    assert sum(k["positions"] for k in once.values()) == 11 * (257 - 2)
    windows = Batches(lessons, lessons.sequences(True), 256, 8, seed=777)
    g = torch.Generator().manual_seed(777 * 1_000_003 + 0)
    pick = torch.randint(len(windows.windows), (8,), generator=g).tolist()
    a, b = windows.batch(0), windows.take(pick)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
