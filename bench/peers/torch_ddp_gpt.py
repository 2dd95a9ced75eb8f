#!/usr/bin/env python3
"""PyTorch peer of Phalanx's GPT-2 training: tokens/s of a byte-level GPT-2.

    python bench/peers/torch_ddp_gpt.py --n-layer 4 --n-head 4 --n-embd 128 \
        --vocab 256 --block-size 128 --micro-batch 8 --steps 20 --nproc 2 \
        --data /usr/share/common-licenses/GPL-3

The defaults are Phalanx's `gpt-tiny` preset (4/4/128, vocab 256, context
128: 0.84M parameters). The model is GPT-2 exactly: learned position
embedding, pre-LayerNorm blocks (eps 1e-5), GELU (tanh), causal
self-attention, biases everywhere, final LayerNorm, lm_head tied to wte, no
dropout; init N(0, 0.02), residual projections (attn.c_proj, mlp.c_proj)
N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm 1/0.

Training: byte-level tokens of --data (each rank samples its own random
windows), cross-entropy, AdamW (lr 3e-4, betas 0.9/0.999, eps 1e-8, weight
decay 0.01 on ndim >= 2 parameters only, as Phalanx/nanoGPT), constant lr,
no clipping unless --grad-clip. --nproc N > 1 runs N local processes with
DistributedDataParallel on gloo (127.0.0.1, a free port); --nproc 1 runs
plainly, without DDP. Each process uses torch.set_num_threads(--threads,
default max(1, cores // nproc)).

Rank 0 prints the loss of every step (mean over ranks, reduced outside the
timed region) and at the end one JSON line
  {"tokens_per_s": ..., "tokens_per_s_median": ..., "step_ms": ..., "params": ..., ...}
measured over the steps after 2 warm-up steps: step_ms = mean step time
(slowest rank), tokens_per_s = nproc * micro_batch * block_size / step time;
tokens_per_s_median the same from the median step time, each step's time
being the slowest rank's, as in torch_ddp_llama.py (bench/engine_compare.sh
sets it against Phalanx's median tokens/s).
A step is: sample batch, zero grads, forward, backward (DDP's bucketed
all-reduce overlaps it), optimizer step.
"""

import argparse
import json
import math
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

AUTOCAST = {"none": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

WARMUP_STEPS = 2


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size, attn):
        super().__init__()
        self.n_head, self.attn = n_head, attn
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        if attn == "manual":
            mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
            self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        hs = C // self.n_head
        q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v))
        if self.attn == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
            att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(dim=-1)
            y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size, attn):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, attn)
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, vocab, block_size, attn="sdpa"):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} is not divisible by n_head {n_head}")
        self.block_size = block_size
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head, block_size, attn) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, eps=1e-5)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init)
        proj_std = 0.02 / math.sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=proj_std)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        T = idx.shape[1]
        pos = torch.arange(T, dtype=torch.long)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt2_num_params(L, C, V, T):
    """Phalanx's Gpt2Config::num_params (tied wte counted once)."""
    per_layer = 4 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)
    return V * C + T * C + L * per_layer + 2 * C


def make_optimizer(model, args):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kw = {"lr": args.lr, "betas": (0.9, 0.999), "eps": 1e-8}
    if args.adamw == "fused":
        try:
            return torch.optim.AdamW(groups, fused=True, **kw), "fused"
        except (RuntimeError, TypeError, ValueError):
            pass  # fall back below
    if args.adamw in ("fused", "foreach"):
        return torch.optim.AdamW(groups, foreach=True, **kw), "foreach"
    return torch.optim.AdamW(groups, foreach=False, **kw), "for-loop"


def load_data(path, vocab):
    with open(path, "rb") as f:
        raw = f.read()
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.long)
    if vocab < 256:
        data = data % vocab
    return data


def worker(rank, args, port):
    n = args.nproc
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // n)
    torch.set_num_threads(threads)
    if n > 1:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=n)
    torch.manual_seed(args.seed)  # same init on every rank (DDP also broadcasts rank 0's)
    model = GPT(args.n_layer, args.n_head, args.n_embd, args.vocab, args.block_size, args.attn)
    params = sum(p.numel() for p in model.parameters())
    expect = gpt2_num_params(args.n_layer, args.n_embd, args.vocab, args.block_size)
    assert params == expect, f"parameter count {params} != GPT-2 formula {expect}"
    net = model
    if n > 1:
        net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    opt, opt_impl = make_optimizer(model, args)

    data = load_data(args.data, args.vocab)
    B, T = args.micro_batch, args.block_size
    if len(data) < T + 2:
        raise SystemExit(f"{args.data}: {len(data)} bytes, need more than block size {T} + 1")
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
    offs = torch.arange(T)

    if rank == 0:
        print(f"# torch_ddp_gpt (torch {torch.__version__}): {params} params, "
              f"L{args.n_layer} H{args.n_head} C{args.n_embd} V{args.vocab} T{T}, "
              f"nproc {n} ({'DDP gloo' if n > 1 else 'no DDP'}), {threads} threads/rank, "
              f"micro-batch {B}, attn {args.attn}, AdamW {opt_impl}, "
              f"data {args.data} ({len(data)} bytes)", flush=True)

    timed = 0.0
    times = []  # each timed step's time, for the median
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
        if step > WARMUP_STEPS:
            timed += dt
            times.append(dt)
        lv = loss.detach().clone()
        if n > 1:  # outside the timed region
            dist.all_reduce(lv)
            lv /= n
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            print(f"step {step:>5}/{args.steps}  loss {lv.item():.4f}  {dt * 1e3:8.1f} ms"
                  f"{'  (warm-up)' if step <= WARMUP_STEPS else ''}", flush=True)

    measured = args.steps - WARMUP_STEPS
    t = torch.tensor([timed], dtype=torch.float64)
    if n > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    step_s = t.item() / measured
    # The slowest rank's time of each step, all-reduced once after the loop
    # so the timed steps are as before.
    tt = torch.tensor(times, dtype=torch.float64)
    if n > 1:
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
    med_s = statistics.median(tt.tolist())
    if rank == 0:
        out = {"tokens_per_s": n * B * T / step_s, "tokens_per_s_median": n * B * T / med_s,
               "step_ms": step_s * 1e3, "params": params,
               "nproc": n, "threads": threads, "micro_batch": B, "block_size": T,
               "n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd,
               "vocab": args.vocab, "steps_timed": measured, "final_loss": lv.item(),
               "attn": args.attn, "adamw": opt_impl, "torch": torch.__version__}
        print(json.dumps(out), flush=True)
    if n > 1:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: cores // nproc)")
    p.add_argument("--data", default="/usr/share/common-licenses/GPL-3", help="any file; bytes are tokens")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=0.0, help="clip global grad norm (0: off)")
    p.add_argument("--adamw", choices=["fused", "foreach", "for-loop"], default="fused")
    p.add_argument("--attn", choices=["sdpa", "manual"], default="sdpa",
                   help="sdpa: F.scaled_dot_product_attention(is_causal); manual: masked softmax")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--autocast", choices=sorted(AUTOCAST), default="none",
                   help="torch.autocast dtype for the forward (none: fp32)")
    p.add_argument("--log-every", type=int, default=1)
    args = p.parse_args()
    if args.steps <= WARMUP_STEPS:
        p.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps")
    if not (1 <= args.vocab <= 256):
        p.error("--vocab must be 1..256 (byte-level data)")
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
        print(f"torch_ddp_gpt: a rank failed:\n{e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
