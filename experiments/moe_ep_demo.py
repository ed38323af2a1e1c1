"""Train a tiny MoE language model with expert parallelism on torch.distributed.

    torchrun --nproc-per-node 4 -m experiments.moe_ep_demo             # 4 CPU ranks (gloo)
    torchrun --nproc-per-node 8 -m experiments.moe_ep_demo --steps 200 # 8 GPUs (NCCL when CUDA is available)

Legend: B sequences per rank, S sequence length, D model dim, V vocabulary (256 bytes), E experts.

A byte-level decoder (attention + moe.MoE feed-forward per block) learns this repository's own text
(docs, moe/, kernels/, experiments/ sources; nothing is downloaded). Every rank draws its own batches (data
parallel) and holds num_experts / world_size experts of every MoE layer (`moe.parallel.expert_parallel`);
`moe.parallel.sync_gradients` averages the replicated gradients and scales the expert-shard gradients, so
each step is the step of the mean loss over ranks. Rank 0 logs, per step: the loss (mean over ranks), the
router losses, the drop fraction (with --capacity-factor), the per-expert load (slots per expert summed
over ranks, per layer) and the all-to-all volume (bytes sent between ranks in the forward dispatch and
combine, summed over layers and ranks; backward moves the same again). At the end it checks that the
replicated parameters are still identical on every rank. --jsonl FILE writes the step records as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import time
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  before init_process_group: see init_distributed
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

import moe
from experiments.text_corpus import repo_files
from experiments.tiny_moe_lm import TinyLMConfig, TinyMoELM
from moe.parallel import expert_parallel, sync_gradients, sync_router_load


def build_model(args: argparse.Namespace) -> TinyMoELM:
    """The byte-level MoE LM of experiments.tiny_moe_lm with the command-line sizes (z-loss 1e-3)."""
    config = TinyLMConfig(
        dim=args.dim,
        heads=args.heads,
        layers=args.layers,
        seq_len=args.seq_len,
        hidden_dim=args.hidden,
        num_experts=args.experts,
        top_k=args.top_k,
        router=args.router,
        capacity_factor=args.capacity_factor,
        aux_loss_coef=args.aux_loss_coef,
        z_loss_coef=1e-3,
    )
    return TinyMoELM(config)


def load_corpus() -> Tensor:
    """uint8 bytes of the repository's text files (sorted paths, so every rank reads the same corpus)."""
    paths = repo_files()
    data = b"\n".join(p.read_bytes() for p in paths)
    if len(data) < 4096:
        raise ValueError(f"found only {len(data)} bytes of text in {len(paths)} repository files")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def sample_batch(corpus: Tensor, args: argparse.Namespace, step: int, rank: int) -> tuple[Tensor, Tensor]:
    """(inputs, targets) [B, S] int64: random windows, seeded by (seed, step, rank)."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    starts = torch.randint(0, corpus.numel() - args.seq_len - 1, (args.batch,), generator=gen)
    windows = torch.stack([corpus[s : s + args.seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


def init_distributed() -> tuple[str, torch.device]:
    """init_process_group from torchrun's environment (NCCL with CUDA, else gloo); 1 rank without torchrun.

    torch._dynamo is imported at the top on purpose: the kernels' custom ops import it on their first call,
    and when that happens after init_process_group (torch 2.13) the gloo group outlives
    destroy_process_group and is torn down during interpreter exit, which sometimes aborts the process.
    """
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ:  # plain `python -m experiments.moe_ep_demo`: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    else:
        dist.init_process_group(backend)
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return backend, device


def all_reduce(t: Tensor) -> Tensor:
    """Sum over ranks (a copy)."""
    t = t.clone()
    dist.all_reduce(t)
    return t


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(
        prog="torchrun ... -m experiments.moe_ep_demo", description=__doc__.split("\n")[0]
    )
    p.add_argument("--steps", type=int, default=20, help="training steps (20)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (8)")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence (64)")
    p.add_argument("--dim", type=int, default=64, help="model dim D (64)")
    p.add_argument("--hidden", type=int, default=128, help="expert hidden dim (128)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (4)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks, each with a MoE layer (2)")
    p.add_argument("--experts", type=int, default=8, help="experts E per MoE layer, divisible by ranks (8)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (2)")
    p.add_argument("--router", default="softmax_topk", help="router name in moe.ROUTERS (softmax_topk)")
    p.add_argument("--capacity-factor", type=float, default=None, help="global capacity factor (dropless)")
    p.add_argument(
        "--aux-loss-coef", type=float, default=0.05, help="Switch load-balancing loss coefficient (0.05)"
    )
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (3e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches (0)")
    p.add_argument("--jsonl", type=Path, default=None, help="rank 0 writes one JSON line per step here")
    return p


def main(argv: list[str] | None = None) -> int:
    """Train; returns the exit status."""
    args = build_parser().parse_args(argv)
    for name in ("steps", "batch", "seq_len", "dim", "hidden", "heads", "layers", "experts", "top_k"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.dim % args.heads:
        raise ValueError(f"--dim={args.dim} must be divisible by --heads={args.heads}")
    backend, device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    try:
        corpus = load_corpus()
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        model = build_model(args).to(device)  # on its device first: the collectives run where the weights are
        layers = moe.moe_layers(model)
        for layer in layers:
            expert_parallel(layer)  # rank r keeps experts r*E/R .. (r+1)*E/R - 1 of every layer
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        say(
            f"expert parallel: {world} ranks ({backend}, {device.type}), {args.layers} MoE layers x "
            f"{args.experts} experts ({args.experts // world} per rank), top-{args.top_k}, dim {args.dim}; "
            f"corpus {corpus.numel():,} bytes; {args.batch}x{args.seq_len} tokens per rank per step"
        )
        records = []
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            inputs, targets = (t.to(device) for t in sample_batch(corpus, args, step, rank))
            logits = model(inputs)
            lm_loss = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
            aux_loss = moe.collect_aux_losses(model).to(device)
            (lm_loss + aux_loss).backward()
            sync_gradients(model, average=True)
            sync_router_load(model)  # keeps sigmoid_bias routers' biases equal (no-op for other routers)
            moe.update_router_biases(model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            with torch.no_grad():
                losses = all_reduce(torch.stack([lm_loss.detach(), aux_loss.detach().float()])) / world
                load_LE = all_reduce(torch.stack([layer.last_tokens_per_expert for layer in layers]))
                moved = sum(
                    layer.last_all_to_all.dispatch_bytes + layer.last_all_to_all.combine_bytes
                    for layer in layers
                )
                a2a_bytes = int(all_reduce(torch.tensor([moved], device=device)))
                drop = [layer.last_global_drop_fraction for layer in layers]
            record = {
                "step": step,
                "loss": float(losses[0]),
                "aux_loss": float(losses[1]),
                "a2a_forward_bytes": a2a_bytes,
                "a2a_forward_backward_bytes": 2 * a2a_bytes,
                "expert_load": load_LE.tolist(),
                "drop_fraction": drop,
                "elapsed_s": time.perf_counter() - start,
            }
            records.append(record)
            load = "  ".join(f"L{i} {row}" for i, row in enumerate(record["expert_load"]))
            say(
                f"step {step:3d}/{args.steps}  loss {record['loss']:.4f}  aux {record['aux_loss']:.4f}  "
                f"a2a {a2a_bytes / 1e6:.3f} MB fwd ({2 * a2a_bytes / 1e6:.3f} MB fwd+bwd)  "
                f"drop {max(drop):.3f}  load {load}"
            )
            if rank == 0 and args.jsonl is not None:
                with args.jsonl.open("a") as f:
                    f.write(json.dumps(record) + "\n")

        # Replicated parameters must stay identical on every rank (same averaged gradients, same optimizer).
        with torch.no_grad():
            shards = {id(p) for layer in layers for p in layer.experts.parameters()}
            replicated = torch.cat(
                [p.reshape(-1).double() for p in model.parameters() if id(p) not in shards]
            )
            reference = replicated.clone()
            dist.broadcast(reference, src=0)
            spread = all_reduce((replicated - reference).abs().max().reshape(1))
        tokens = args.steps * args.batch * args.seq_len * world
        elapsed = time.perf_counter() - start
        same = float(spread) == 0.0
        first, last = records[0]["loss"], records[-1]["loss"]
        say(
            f"done: loss {first:.4f} -> {last:.4f} (ln 256 = {math.log(256):.3f}), "
            f"{tokens / elapsed:,.0f} tokens/s over {world} ranks; replicated parameters identical on all "
            f"ranks: {'yes' if same else f'NO (max difference {float(spread):.3g})'}"
        )
        dist.barrier()  # nobody tears gloo down while a peer still talks to it
        return 0 if same else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
