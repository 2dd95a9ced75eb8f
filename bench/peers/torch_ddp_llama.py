#!/usr/bin/env python3
"""PyTorch peer of Phalanx's Llama training: tokens/s of transformers' LlamaForCausalLM.

    python bench/peers/torch_ddp_llama.py --preset llama-60m --micro-batch 4 \
        --steps 6 --nproc 2 --data data/corpus.txt

The model is transformers' `LlamaForCausalLM` built from a `LlamaConfig`
with exactly the shapes of a Phalanx preset (`--preset`, or the shape flags):
SwiGLU ("silu"), no biases, RMSNorm eps 1e-5, rope theta 10000, untied head,
init N(0, 0.02) (transformers' own init), attention `--attn sdpa` (default)
or `eager`, float32. The parameter count is asserted against Phalanx's
`LlamaConfig::num_params` (llama-60m: 60,175,104).

Training is torch_ddp_gpt.py's: byte-level tokens of --data (random windows
drawn separately on each rank), cross-entropy over the logits, AdamW
(weight decay on ndim >= 2 parameters only, `--adamw fused` by default),
clipping with --grad-clip (Phalanx's default 1.0). --nproc N > 1 runs DDP
on gloo; --nproc 1 runs without DDP. torch.set_num_threads(--threads,
default cores // nproc).

Rank 0 prints each step's loss and time, then one JSON line
  {"tokens_per_s": ..., "tokens_per_s_median": ..., "step_ms": ..., "step_ms_all": [...], ...}
over the steps after 2 warm-up steps, each step's time being the slowest
rank's: tokens_per_s from the mean step time, tokens_per_s_median from the
median one (nproc * micro_batch * block_size / step time).
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_ddp_gpt import AUTOCAST, WARMUP_STEPS, load_data, make_optimizer  # noqa: E402

# Phalanx's presets (crates/phalanx-models/src/llama/config.rs):
# layers, heads, kv heads, width, MLP width, vocabulary, context.
PRESETS = {
    "llama-tiny": (4, 4, 2, 128, 352, 256, 128),
    "llama-60m": (8, 12, 4, 768, 2560, 256, 256),
}


def llama_num_params(L, H, KV, C, I, V):
    """Phalanx's LlamaConfig::num_params for an untied head, head_dim C / H."""
    d = C // H
    attn = C * H * d + 2 * C * KV * d + H * d * C
    per_layer = attn + 3 * C * I + 2 * C
    return 2 * V * C + L * per_layer + C


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.n_embd,
                      intermediate_size=args.intermediate_size,
                      num_hidden_layers=args.n_layer, num_attention_heads=args.n_head,
                      num_key_value_heads=args.n_kv_head,
                      max_position_embeddings=args.block_size, rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
                      attention_bias=False, mlp_bias=False, initializer_range=0.02,
                      use_cache=False)
    cfg._attn_implementation = args.attn
    return LlamaForCausalLM(cfg).float()


class LossOf(nn.Module):
    """Cross-entropy of the model's logits, so DDP wraps one forward."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        logits = self.model(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def worker(rank, args, port):
    n = args.nproc
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // n)
    torch.set_num_threads(threads)
    if n > 1:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=n)
    torch.manual_seed(args.seed)
    model = build(args)
    params = sum(p.numel() for p in model.parameters())
    expect = llama_num_params(args.n_layer, args.n_head, args.n_kv_head, args.n_embd,
                              args.intermediate_size, args.vocab)
    assert params == expect, f"parameter count {params} != Phalanx's {expect}"
    net = LossOf(model)
    if n > 1:
        net = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=args.bucket_mb)
    opt, opt_impl = make_optimizer(model, args)

    data = load_data(args.data, args.vocab)
    B, T = args.micro_batch, args.block_size
    if len(data) < T + 2:
        raise SystemExit(f"{args.data}: {len(data)} bytes, need more than block size {T} + 1")
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
    offs = torch.arange(T)

    if rank == 0:
        print(f"# torch_ddp_llama (torch {torch.__version__}): {params} params, "
              f"L{args.n_layer} H{args.n_head}/{args.n_kv_head} C{args.n_embd} "
              f"I{args.intermediate_size} V{args.vocab} T{T}, "
              f"nproc {n} ({'DDP gloo' if n > 1 else 'no DDP'}), {threads} threads/rank, "
              f"micro-batch {B}, attn {args.attn}, AdamW {opt_impl}, "
              f"data {args.data} ({len(data)} bytes)", flush=True)

    times = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        ix = torch.randint(len(data) - T - 1, (B,), generator=gen)
        idx = ix[:, None] + offs
        x, y = data[idx], data[idx + 1]
        opt.zero_grad(set_to_none=True)
        # torch.autocast(bfloat16 / float16) on CPU: the half-precision
        # peer of `train.precision` (fp32 weights, half compute).
        with torch.autocast("cpu", dtype=AUTOCAST[args.autocast], enabled=args.autocast != "none"):
            loss = net(x, y)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        dt = time.perf_counter() - t0
        # Outside the timed region: the slowest rank's time and the mean loss.
        st = torch.tensor([dt, loss.item()], dtype=torch.float64)
        if n > 1:
            tmax = torch.tensor([dt], dtype=torch.float64)
            dist.all_reduce(tmax, op=dist.ReduceOp.MAX)
            dist.all_reduce(st)
            st /= n
            dt = tmax.item()
        if step > WARMUP_STEPS:
            times.append(dt)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            print(f"step {step:>5}/{args.steps}  loss {st[1].item():.4f}  {dt * 1e3:8.1f} ms"
                  f"{'  (warm-up)' if step <= WARMUP_STEPS else ''}", flush=True)

    if rank == 0:
        mean_s, med_s = statistics.mean(times), statistics.median(times)
        out = {"tokens_per_s": n * B * T / mean_s, "tokens_per_s_median": n * B * T / med_s,
               "step_ms": mean_s * 1e3, "step_ms_all": [round(t * 1e3, 1) for t in times],
               "params": params, "nproc": n, "threads": threads, "micro_batch": B,
               "block_size": T, "n_layer": args.n_layer, "n_head": args.n_head,
               "n_kv_head": args.n_kv_head, "n_embd": args.n_embd,
               "intermediate_size": args.intermediate_size, "vocab": args.vocab,
               "steps_timed": len(times), "final_loss": st[1].item(), "attn": args.attn,
               "adamw": opt_impl, "torch": torch.__version__}
        print(json.dumps(out), flush=True)
    if n > 1:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-60m",
                   help="Phalanx preset whose shapes to use; the flags below override it")
    for flag in ("n-layer", "n-head", "n-kv-head", "n-embd", "intermediate-size", "vocab",
                 "block-size"):
        p.add_argument(f"--{flag}", type=int, default=0)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: cores // nproc)")
    p.add_argument("--data", default="data/corpus.txt", help="any file; bytes are tokens")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="clip global grad norm (0: off)")
    p.add_argument("--adamw", choices=["fused", "foreach", "for-loop"], default="fused")
    p.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--autocast", choices=sorted(AUTOCAST), default="none",
                   help="torch.autocast dtype for the forward (none: fp32)")
    p.add_argument("--log-every", type=int, default=1)
    args = p.parse_args()
    shape = dict(zip(("n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size", "vocab",
                      "block_size"), PRESETS[args.preset]))
    for k, v in shape.items():
        if not getattr(args, k):
            setattr(args, k, v)
    if args.steps <= WARMUP_STEPS:
        p.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps")
    if not (1 <= args.vocab <= 256):
        p.error("--vocab must be 1..256 (byte-level data)")
    if args.n_embd % args.n_head or args.n_head % args.n_kv_head:
        p.error("--n-head must divide --n-embd and --n-kv-head must divide --n-head")
    if args.nproc < 1 or args.log_every < 1:
        p.error("--nproc and --log-every must be >= 1")
    if not os.path.isfile(args.data):
        p.error(f"--data {args.data!r} is not a file")
    if args.nproc == 1:
        worker(0, args, 0)
        return 0
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(worker, args=(args, port), nprocs=args.nproc, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        print(f"torch_ddp_llama: a rank failed:\n{e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
