"""Small models for the FSDP tests: a GPT with tied embeddings and an MoE with uneven routing."""
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # a key bias gets only round-off gradient
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=96, dim=64, heads=4, layers=4, seq=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class Expert(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(F.relu(self.up(x)))


class MoELayer(nn.Module):
    """Top-1 routing over many experts: each rank's tokens reach only some of them."""

    def __init__(self, dim, experts, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(experts))

    def forward(self, x):
        h = self.norm(x)
        probs = self.router(h).softmax(-1)
        weight, choice = probs.max(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if mask.any():
                out[mask] = weight[mask, None] * expert(h[mask])
        return x + out


class MoE(nn.Module):
    def __init__(self, vocab=64, dim=32, experts=8, hidden=64, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MoELayer(dim, experts, hidden) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def units_of(model):
    """The modules to wrap as units, innermost first (the root last)."""
    return list(model.blocks if hasattr(model, "blocks") else model.layers)


def make(kind, seed=0):
    torch.manual_seed(seed)
    return GPT() if kind == "gpt" else MoE()


def batch(kind, step, size, seq=16, seed=1234):
    gen = torch.Generator().manual_seed(seed + step)
    vocab = 96 if kind == "gpt" else 64
    idx = torch.randint(0, vocab, (size, seq), generator=gen)
    return idx, torch.roll(idx, -1, dims=1)


def rank_micro_batches(kind, step, rank, world, micro, accum):
    """This rank's `accum` micro-batches of `micro` samples from the global batch of `step`
    (micro x accum x world samples), as the data-parallel ranks of a reference run split it."""
    idx, tgt = batch(kind, step, micro * accum * world)
    mine = slice(rank * micro * accum, (rank + 1) * micro * accum)
    idx, tgt = idx[mine], tgt[mine]
    return [(idx[k * micro:(k + 1) * micro], tgt[k * micro:(k + 1) * micro])
            for k in range(accum)]


def train_steps(engine, rank, world, steps, global_batch):
    """`steps` optimizer steps of the GPT on global batches of `global_batch` samples (batch
    `engine.global_steps` each), this rank taking its slice; the world's mean loss per step."""
    import torch.distributed as dist
    losses = []
    for _ in range(steps):
        idx, tgt = batch("gpt", engine.global_steps, global_batch)
        part = slice(rank * global_batch // world, (rank + 1) * global_batch // world)
        loss = engine(idx[part], tgt[part])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses
