"""The drafter-training recipe end to end (`experiments.train_drafter.train`) on a small synthetic cache.

The recipe's promise is that a run is a pure function of its config: the same config gives the same
weights, and a run interrupted and resumed from its checkpoint gives the weights of an uninterrupted run
(batches and noise are seeded by step). The shipped head was checked the same way at full size (two
3,000-step runs, bitwise identical weights; see the model card).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from experiments.drafter_data import DataConfig, FeatureData, _cache_root, aux_shard_name, load_dataset
from experiments.train_drafter import (
    TrainConfig,
    _key_fields,
    build_draft_vocab,
    grow_draft_vocab,
    main,
    train,
)
from specdec.drafters.eagle import load_eagle_head, target_parts
from specdec.targets.loading import load_hf_model

pytestmark = pytest.mark.model  # the recipe loads the real SmolLM2-135M for its embedding and LM head

DIM, TOPK = 576, 8  # SmolLM2-135M's width; the top-k the cache stores


class Interrupted(Exception):
    pass


def _fake_cache(root, data: DataConfig, aux_layers: tuple[int, ...] = ()) -> None:
    """A finished feature cache with random features: 10 training and 2 held-out sequences (and
    random ``aux_layers`` features beside the shard, as ``build_aux_features`` writes them)."""
    g = torch.Generator().manual_seed(0)
    lengths = [40, 33, 50, 21, 64, 45, 38, 29, 57, 48, 30, 36]
    n = sum(lengths)
    tokens = torch.randint(0, 300, (n,), generator=g)
    probs = torch.rand(n, TOPK, generator=g).sort(dim=-1, descending=True).values
    # the target's top-k next tokens: the next token first, then others
    others = torch.randint(0, 300, (n, TOPK - 1), generator=g)
    topk_ids = torch.cat([tokens.roll(-1)[:, None], others], dim=1)
    out = _cache_root(data, root)
    out.mkdir(parents=True)
    save_file(
        {
            "tokens": tokens.to(torch.int32),
            "features": (torch.randn(n, DIM, generator=g) * 30).half(),
            "topk_ids": topk_ids.to(torch.int32),
            "topk_probs": (probs / probs.sum(-1, keepdim=True)).half(),
            "lengths": torch.tensor(lengths),
            "heldout": torch.tensor([i >= 10 for i in range(len(lengths))]),
        },
        str(out / "shard.safetensors"),
        metadata={"names": json.dumps([f"seq/{i}" for i in range(len(lengths))])},
    )
    if aux_layers:
        aux = (torch.randn(n, len(aux_layers), DIM, generator=g) * 5).half()
        save_file({"aux": aux}, str(out / aux_shard_name("shard.safetensors", aux_layers)))
    (out / "manifest.json").write_text(json.dumps({"shards": ["shard.safetensors"], "complete": True}))


def _run(tmp_path, name: str, cfg: TrainConfig, log=lambda s: None) -> dict:
    return train(
        cfg,
        out=tmp_path / f"{name}.safetensors",
        work=tmp_path / f"work-{name}",
        data_root=tmp_path / "data",
        evaluate=False,
        log=log,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("recipe")
    cfg = TrainConfig(  # with EAGLE-3's fused input: the recipe's fullest path
        steps=20,
        seq_len=16,
        batch_size=3,
        draft_vocab_size=64,
        unroll=2,
        eval_every=10,
        ckpt_every=4,
        aux_layers=(1, 14),
    )
    _fake_cache(tmp_path / "data", cfg.data, cfg.aux_layers)
    summaries = {"straight": _run(tmp_path, "straight", cfg), "again": _run(tmp_path, "again", cfg)}

    def stop_at_step_10(line: str) -> None:  # the log line of step 10 comes before its checkpoint
        if line.startswith("[train] step 10/"):
            raise Interrupted

    with pytest.raises(Interrupted):
        _run(tmp_path, "resumed", cfg, log=stop_at_step_10)
    lines: list[str] = []
    summaries["resumed"] = _run(tmp_path, "resumed", cfg, log=lines.append)
    summaries["other_seed"] = _run(tmp_path, "other_seed", replace(cfg, seed=1))
    weights = {name: load_file(str(tmp_path / f"{name}.safetensors")) for name in summaries}
    return {"summaries": summaries, "weights": weights, "resume_log": lines, "tmp": tmp_path, "cfg": cfg}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_same_config_gives_bitwise_the_same_head(runs):
    w, s = runs["weights"], runs["summaries"]
    assert _same(w["straight"], w["again"])
    assert w["straight"]["fc_aux.weight"].shape == (DIM, 3 * DIM)  # the fused input was trained
    assert s["straight"]["heldout_curve"] == s["again"]["heldout_curve"]
    assert not _same(w["straight"], w["other_seed"])  # the comparison can fail


def test_interrupted_run_resumes_to_the_uninterrupted_head(runs):
    assert any("resumed at step 8" in line for line in runs["resume_log"])  # last checkpoint before 10
    assert _same(runs["weights"]["straight"], runs["weights"]["resumed"])
    assert runs["summaries"]["resumed"]["heldout_curve"] == runs["summaries"]["straight"]["heldout_curve"]


def test_init_from_starts_at_the_given_weights(runs):
    """Fine-tuning starts from the file: at learning rate 0 the run writes the file's weights back
    bit for bit (its draft vocabulary in stored order, too); a token-loss-only run moves them."""
    tmp, cfg = runs["tmp"], runs["cfg"]
    start = str(tmp / "straight.safetensors")
    lines: list[str] = []
    still = _run(tmp, "still", replace(cfg, init_from=start, steps=2, lr=0.0), log=lines.append)
    assert any("starting from the weights" in line for line in lines)
    assert still["config"]["init_from"] == start
    w = load_file(str(tmp / "still.safetensors"))
    assert _same(w, runs["weights"]["straight"])
    tuned = _run(tmp, "tuned", replace(cfg, init_from=start, steps=4, reg_weight=0.0, ce_weight=1.0))
    w_tuned = load_file(str(tmp / "tuned.safetensors"))
    assert torch.equal(w_tuned["draft_vocab_N"], w["draft_vocab_N"])
    assert not torch.equal(w_tuned["fc.weight"], w["fc.weight"])
    assert len(tuned["heldout_curve"]) == 1  # evaluated at its last step


def test_init_from_grows_the_draft_vocabulary(runs):
    """A larger draft_vocab_size keeps the file's tokens first (in stored order) and its weights, and
    adds the data's most frequent tokens the file lacks; the grown head trains and saves."""
    tmp, cfg = runs["tmp"], runs["cfg"]
    start = str(tmp / "straight.safetensors")
    _run(tmp, "grown", replace(cfg, init_from=start, steps=2, lr=0.0, draft_vocab_size=96))
    w0, w = runs["weights"]["straight"], load_file(str(tmp / "grown.safetensors"))
    vocab = w["draft_vocab_N"]
    assert vocab.shape == (96,) and vocab.unique().numel() == 96
    assert torch.equal(vocab[:64], w0["draft_vocab_N"])
    assert all(torch.equal(w[k], w0[k]) for k in w0 if k != "draft_vocab_N")
    # the added tokens are the next most frequent top-1 predictions of the training split
    data = load_dataset(_cache_root(cfg.data, tmp / "data"), cfg.aux_layers)
    order, _ = build_draft_vocab(data, data.sequences(False), 300)
    expected = [t for t in order.tolist() if t not in set(w0["draft_vocab_N"].tolist())][:32]
    assert vocab[64:].tolist() == expected
    _run(tmp, "grown_tuned", replace(cfg, init_from=start, steps=3, draft_vocab_size=96))
    assert not torch.equal(load_file(str(tmp / "grown_tuned.safetensors"))["fc.weight"], w["fc.weight"])


def test_grow_draft_vocab_checks_its_arguments():
    stored, frequent = torch.tensor([5, 2, 9]), torch.tensor([2, 7, 5, 1, 9, 3])
    assert grow_draft_vocab(stored, frequent, 5).tolist() == [5, 2, 9, 7, 1]
    assert grow_draft_vocab(stored, frequent, 3).tolist() == [5, 2, 9]
    with pytest.raises(ValueError, match="n must be >= the stored vocabulary's 3"):
        grow_draft_vocab(stored, frequent, 2)
    with pytest.raises(ValueError, match="draft_vocab_size 7: the data rank only 6"):
        grow_draft_vocab(stored, frequent, 7)


def test_draft_vocab_ranks_top1_then_topk_frequency():
    """Top-1 predictions first by frequency (ties by id, as the shipped head's vocabulary was built);
    then tokens that are never top-1, by how often they appear in the top-k; held-out rows ignored."""
    ids = torch.tensor(
        [[4, 9, 7], [4, 7, 9], [2, 7, 8], [2, 9, 8], [6, 8, 3], [4, 5, 8]]  # train rows
        + [[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]]  # held-out rows: 1 would lead if counted
    )
    n = ids.shape[0]
    data = FeatureData(
        tokens=torch.zeros(n, dtype=torch.long),
        features=torch.zeros(n, 1).half(),
        topk_ids=ids,
        topk_probs=torch.ones(n, 3).half(),
        offsets=torch.tensor([0, 6, n]),
        heldout=torch.tensor([False, True]),
        names=["train", "held"],
    )
    order, coverage = build_draft_vocab(data, data.sequences(False), 9)
    # top-1: 4 (3×), 2 (2×), 6 (1×); then by top-k appearances: 8 (4×), 7 and 9 (3×, by id), 3, 5, 0
    assert order.tolist() == [4, 2, 6, 8, 7, 9, 3, 5, 0]
    assert coverage[1024] == 1.0
    assert build_draft_vocab(data, data.sequences(False), 2)[0].tolist() == [4, 2]


def test_init_from_keys_checkpoints_by_content(runs, tmp_path):
    cfg = runs["cfg"]
    a, b = runs["tmp"] / "straight.safetensors", runs["tmp"] / "other_seed.safetensors"
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(a.read_bytes())
    key = _key_fields(replace(cfg, init_from=str(a)))
    assert key == _key_fields(replace(cfg, init_from=str(copy)))  # same contents, other path
    assert key != _key_fields(replace(cfg, init_from=str(b)))
    assert "init_from" not in _key_fields(cfg)  # fresh runs keep their directories


def test_init_from_rejects_weights_that_do_not_fit(runs):
    cfg, start = runs["cfg"], str(runs["tmp"] / "straight.safetensors")
    with pytest.raises(ValueError, match="fuses target layers \\[1, 14\\].*--aux-layers '1,14'"):
        _run(runs["tmp"], "no_aux", replace(cfg, init_from=start, aux_layers=()))
    with pytest.raises(ValueError, match="vocabulary of 64.*not shrink.*--draft-vocab-size 64"):
        _run(runs["tmp"], "vocab", replace(cfg, init_from=start, draft_vocab_size=32))
    with pytest.raises(ValueError, match="no such file"):
        _run(runs["tmp"], "missing", replace(cfg, init_from=str(runs["tmp"] / "nope.safetensors")))
    with pytest.raises(ValueError, match="no such file"):  # the CLI flag reaches the config
        main(["--init-from", str(runs["tmp"] / "nope.safetensors"), "--data-root", str(runs["tmp"] / "data")])


def test_prev_token_input_trains_and_init_from_adds_the_block_at_zero(runs):
    """--prev-token-input: a fresh head's fc takes [embed(x_{t+1}); f_t; embed(x_t)] and trains; from
    a file without the block, the block starts at zero (at lr 0 the file's weights come back with
    zero columns appended, so the head computes what the file's did) and then learns; a file with
    the block refuses a run without it. The flag keys the checkpoint only when on."""
    tmp = runs["tmp"]
    assert runs["cfg"].prev_token_input  # the recipe's default since the copy lessons
    assert load_file(str(tmp / "straight.safetensors"))["fc.weight"].shape == (DIM, 3 * DIM)
    cfg = replace(runs["cfg"], prev_token_input=False, steps=3)
    _run(tmp, "no_prev", cfg)
    w0 = load_file(str(tmp / "no_prev.safetensors"))
    assert w0["fc.weight"].shape == (DIM, 2 * DIM)
    fresh = replace(cfg, prev_token_input=True)
    _run(tmp, "prev_fresh", fresh)
    w_fresh = load_file(str(tmp / "prev_fresh.safetensors"))
    assert w_fresh["fc.weight"].shape == (DIM, 3 * DIM)
    start = str(tmp / "no_prev.safetensors")
    _run(tmp, "prev_still", replace(fresh, init_from=start, steps=2, lr=0.0))
    w = load_file(str(tmp / "prev_still.safetensors"))
    assert torch.equal(w["fc.weight"][:, : 2 * DIM], w0["fc.weight"])
    assert not w["fc.weight"][:, 2 * DIM :].any()
    assert all(torch.equal(w[k], w0[k]) for k in w0 if k != "fc.weight")
    _run(tmp, "prev_tuned", replace(fresh, init_from=start, steps=3))
    assert load_file(str(tmp / "prev_tuned.safetensors"))["fc.weight"][:, 2 * DIM :].abs().max() > 0
    with pytest.raises(ValueError, match="prev_token_input.*--prev-token-input"):
        _run(tmp, "prev_dropped", replace(cfg, init_from=str(tmp / "prev_fresh.safetensors")))
    assert "prev_token_input" not in _key_fields(cfg)
    assert _key_fields(fresh)["prev_token_input"] is True


def test_num_layers_trains_and_init_from_adds_layers_at_zero_output(runs):
    """--num-layers 2: a fresh head gets a second, pre-norm layer and trains it; from a one-layer
    file the added layer starts with zero output projections (at lr 0 the file's weights come back
    unchanged beside it, and the head's predictions equal the file's), then learns; a file with more
    layers than the run refuses. The field keys the checkpoint only when it is not 1."""
    tmp, cfg = runs["tmp"], runs["cfg"]
    start = str(tmp / "straight.safetensors")
    w0 = runs["weights"]["straight"]
    _run(tmp, "deep_still", replace(cfg, init_from=start, steps=2, lr=0.0, num_layers=2))
    w = load_file(str(tmp / "deep_still.safetensors"))
    assert all(torch.equal(w[k], w0[k]) for k in w0)
    added = {k for k in w if k not in w0}
    assert {k.split(".", 2)[2] for k in added} == {
        "input_norm",
        "qkv_proj.weight",
        "o_proj.weight",
        "post_norm",
        "gate_up_proj.weight",
        "down_proj.weight",
    }
    assert not w["extra_layers.0.o_proj.weight"].any() and not w["extra_layers.0.down_proj.weight"].any()
    assert w["extra_layers.0.qkv_proj.weight"].abs().max() > 0  # a fresh init, so it can learn
    # the grown head computes what the file's does
    data = load_dataset(_cache_root(cfg.data, tmp / "data"), cfg.aux_layers)
    parts = target_parts(load_hf_model(cfg.data.target))
    one, _ = load_eagle_head(start, parts)
    two, _ = load_eagle_head(tmp / "deep_still.safetensors", parts)
    assert two.config.num_layers == 2 and one.config.num_layers == 1
    feats = data.features[:12].float().unsqueeze(0)
    tokens = data.tokens[:13].unsqueeze(0)
    with torch.no_grad():
        f1 = one(one.project(feats, data.aux[:12].float().unsqueeze(0)), tokens[:, 1:], tokens[:, :-1])
        f2 = two(two.project(feats, data.aux[:12].float().unsqueeze(0)), tokens[:, 1:], tokens[:, :-1])
    torch.testing.assert_close(f2, f1)
    _run(tmp, "deep_tuned", replace(cfg, init_from=start, steps=3, num_layers=2))
    assert load_file(str(tmp / "deep_tuned.safetensors"))["extra_layers.0.o_proj.weight"].abs().max() > 0
    fresh = _run(tmp, "deep_fresh", replace(cfg, steps=3, num_layers=2))
    assert fresh["config"]["num_layers"] == 2
    with pytest.raises(ValueError, match="2 decoder layers.*--num-layers 2"):
        _run(tmp, "deep_dropped", replace(cfg, init_from=str(tmp / "deep_fresh.safetensors")))
    assert "num_layers" not in _key_fields(cfg)
    assert _key_fields(replace(cfg, num_layers=2))["num_layers"] == 2
