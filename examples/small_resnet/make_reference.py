#!/usr/bin/python3
"""PyTorch's side of examples/small_resnet: the reference that main.c is checked against.

Builds SmallResNet (the model main.c builds with aotgrad's public API, same parameter names),
seeds it, and writes to this folder:
  weights.safetensors  its initial state_dict (parameters and BatchNorm buffers), float32
  data.safetensors     the data set: x [64, 3, 8, 8] float32, y [64] int64 (10 classes)
  final.safetensors    the state_dict after STEPS training steps in float32
  reference.txt        per step: the float32 loss, and the loss of the same run in float64
Training: step s uses samples [16 (s mod 4), 16 (s mod 4) + 16), model in training mode
(BatchNorm normalizes with the batch's statistics and updates its running ones), mean
cross-entropy, SGD(lr 0.05, momentum 0.9, weight_decay 5e-4).

The float64 run starts from the same weights and data (converted): its distance from the
float32 run is how far float32 rounding alone moves a correct implementation, which is what
main.c's tolerance is built on.

Needs PyTorch (Debian: apt-get install python3-torch, 1.13) and nothing else; the safetensors
files are written here by hand (8-byte little-endian header length, JSON header, raw data).
Run with the system Python: /usr/bin/python3 examples/small_resnet/make_reference.py
"""
import json
import os
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = 20
BATCH = 16
NSAMPLES = 64
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 5e-4
HERE = os.path.dirname(os.path.abspath(__file__))


class ResidualBlock(nn.Module):
    """relu(x + bn2(conv2(relu(bn1(conv1(x))))))"""

    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(h)))


class SmallResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = ResidualBlock(8)
        self.pool = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.norm = nn.LayerNorm(8 * 4 * 4)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = self.pool(self.block(self.stem(x)))
        return self.fc2(self.act(self.fc1(self.norm(self.flatten(x)))))


ST_DTYPE = {torch.float32: "F32", torch.float64: "F64", torch.int64: "I64"}


def save_safetensors(path, tensors):
    """tensors: dict name -> tensor, written in that order, contiguous, little-endian."""
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        b = t.detach().contiguous().cpu().numpy().tobytes()
        header[name] = {"dtype": ST_DTYPE[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def make_data():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(NSAMPLES, 3, 8, 8, generator=g)
    # Labels from a fixed random teacher (a linear map of 2x2-average-pooled pixels), so that
    # there is something to learn.
    teacher = torch.randn(3 * 4 * 4, 10, generator=g)
    y = (F.avg_pool2d(x, 2).flatten(1) @ teacher).argmax(1)
    return x, y


def train(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM,
                          weight_decay=WEIGHT_DECAY)
    model.train()
    losses = []
    for s in range(STEPS):
        i = (s % (NSAMPLES // BATCH)) * BATCH
        loss = F.cross_entropy(model(x[i:i + BATCH]), y[i:i + BATCH])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    model = SmallResNet()
    x, y = make_data()
    save_safetensors(os.path.join(HERE, "weights.safetensors"), model.state_dict())
    save_safetensors(os.path.join(HERE, "data.safetensors"), {"x": x, "y": y})

    model64 = SmallResNet().double()
    model64.load_state_dict(model.state_dict())  # the same initial weights, as float64
    losses64 = train(model64, x.double(), y)
    losses = train(model, x, y)
    save_safetensors(os.path.join(HERE, "final.safetensors"), model.state_dict())

    with open(os.path.join(HERE, "reference.txt"), "w") as f:
        f.write("# examples/small_resnet/make_reference.py, torch %s: step, float32 loss, "
                "float64 loss\n" % torch.__version__)
        for s, (a, b) in enumerate(zip(losses, losses64)):
            f.write("%d %.9g %.17g\n" % (s + 1, a, b))
    dev = max(abs(a - b) for a, b in zip(losses, losses64))
    pdev = max((p - q.float()).abs().max().item()
               for p, q in zip(model.state_dict().values(), model64.state_dict().values()))
    print("losses %.6f -> %.6f; float32 vs float64: losses differ by at most %.3g, final "
          "parameters and buffers by at most %.3g" % (losses[0], losses[-1], dev, pdev),
          file=sys.stderr)


if __name__ == "__main__":
    main()
