#!/usr/bin/python3
"""PyTorch eager reference for `aotgrad bench`: the same three models, shapes, losses and
optimizer, timed the same way (forward + backward + AdamW step + zero_grad, median seconds per
step after warm-up), so that one bench session can put aotgrad's steps beside PyTorch's.

    /usr/bin/python3 bench/torch_reference.py [mlp] [cnn] [gpt2-small] [--runs N] [--warmup N]
                                     [--threads T] [--json FILE]

Needs Debian's python3-torch (PyTorch 1.13, CPU), which the project's scripts do not install
(about 240 packages): `apt-get install python3-torch`. The models follow docs/PERFORMANCE.md
("The models"): weights are PyTorch's own random initialization, not aotgrad's, which does
not change the work. GPT-2's attention is written out (matmul, causal mask, softmax, matmul)
because PyTorch 1.13 has no fused scaled_dot_product_attention; aotgrad runs its flash
attention kernel there, a difference this reference states rather than hides."""

import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def build_mlp():
    layers = []
    for i in range(8):
        layers.append(nn.Linear(1024, 1024))
        if i < 7:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    x = torch.randn(256, 1024)
    y = torch.randint(0, 1024, (256,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01)
    return model, (lambda: F.cross_entropy(model(x), y)), opt


class FashionCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1, 1)
        self.bn1 = nn.BatchNorm2d(32)
        self.pool1 = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(32, 64, 3, 1, 1)
        self.bn2 = nn.BatchNorm2d(64)
        self.pool2 = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        h = self.pool1(F.relu(self.bn1(self.conv1(x))))
        h = self.pool2(F.relu(self.bn2(self.conv2(h))))
        h = F.relu(self.fc1(torch.flatten(h, 1)))
        return self.fc2(h)


def build_cnn():
    model = FashionCNN().train()
    x = torch.rand(128, 1, 28, 28)
    y = torch.randint(0, 10, (128,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01)
    return model, (lambda: F.cross_entropy(model(x), y)), opt


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln_1 = nn.LayerNorm(C)
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C)
        self.c_fc = nn.Linear(C, 4 * C)
        self.mlp_proj = nn.Linear(4 * C, C)

    def attn(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.H, C // self.H).transpose(1, 2)
        k = k.view(B, T, self.H, C // self.H).transpose(1, 2)
        v = v.view(B, T, self.H, C // self.H).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, n_layer=12, n_head=12, n_embd=768, vocab=50257, block=1024):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as aotgrad's GPT-2

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for b in self.h:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build_gpt2_small():
    model = GPT2().train()
    idx = torch.randint(0, 50257, (4, 64))
    tgt = torch.randint(0, 50257, (4, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    return model, (lambda: model(idx, tgt)), opt


MODELS = {"mlp": build_mlp, "cnn": build_cnn, "gpt2-small": build_gpt2_small}


def time_model(name, runs, warmup):
    torch.manual_seed(0)
    model, loss_fn, opt = MODELS[name]()

    def step():
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(warmup):
        if not math.isfinite(step()):
            raise SystemExit(f"torch_reference: {name}: non-finite loss in warm-up")
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", metavar="MODEL", help="mlp, cnn, gpt2-small (all)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json")
    a = ap.parse_args()
    bad = [m for m in a.models if m not in MODELS]
    if bad:
        ap.error(f"unknown model {bad[0]!r}; choose from {', '.join(MODELS)}")
    names = a.models or list(MODELS)
    torch.set_num_threads(a.threads)
    print(f"torch_reference: PyTorch {torch.__version__} eager, {torch.get_num_threads()} threads, "
          f"median of {a.runs} steps after {a.warmup} warm-up step(s)")
    print(f"  {'model':<11} {'eager s':>9}")
    out = {"torch_version": torch.__version__, "threads": torch.get_num_threads(), "results": []}
    for n in names:
        s = time_model(n, a.runs, a.warmup)
        print(f"  {n:<11} {s:9.4f}", flush=True)
        out["results"].append({"model": n, "eager_step_s": s})
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=2)
        os.replace(tmp, a.json)


if __name__ == "__main__":
    main()
