"""Whether ``torch.compile`` shortens the feature draft's drafting step on this CPU (issue 37: "torch.compile of the
draft step").

    python docs/experiments/draft_compile.py --output docs/experiments/draft_compile-epyc.json

The committed bundle's draft (bf16, 2 threads) after a 64-token greedy continuation of the chat's first built-in
prompt (it chooses nothing). One drafting step — the draft's forward for one token and its logits over the kept
vocabulary, sampling and the head left out — three ways, each right after a one-token target pass as decoding
alternates them, interleaved, medians of ``--repeats``:

* ``eager``: what decoding runs, :meth:`FeatureDraft.step` over a ``DynamicCache`` then ``support_logits``;
* ``static``: the same maths over a preallocated ``StaticCache`` (fixed shapes, the whole cache attended, masked);
* ``compiled``: that static step under ``torch.compile`` (the target runtime's backend,
  :func:`accept_head.models.row_linear.backend`: one-row bf16 linears summed; int8 linears stay int8 products).

``--draft_weights bf16`` decodes the draft as trained instead of the bundle's int8 (whose products the backend does not
rewrite).

The logits of the static and compiled steps are compared with the eager step's (bf16: they differ in the last bits;
decoding would stay lossless either way, since verification uses the q the draft computed).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, StaticCache

from accept_head.core.hf_compat import cache_kwargs, crop_cache
from accept_head.core.prompts import chat_prompt_ids
from accept_head.core.records import machine_info, write_json
from accept_head.models.loading import load_model
from accept_head.models.row_linear import backend
from accept_head.models.static_target import INDUCTOR_OPTIONS
from accept_head.specdecpp.bundle import SpecDecPP
from accept_head.specdecpp.chat import DEFAULT_PROMPTS


def static_step(draft, cache: dict, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
    """The draft's forward over a ``StaticCache`` (``cache``: its keyword arguments) and the logits of the last
    position over the kept vocabulary, in ascending id order (as ``support_logits``)."""
    x = draft.fc(torch.cat([features, draft.embed(tokens).to(features.dtype)], dim=-1))
    out = draft.decoder(inputs_embeds=x, **cache, cache_position=positions, position_ids=positions[None])
    return draft._head_rows(sort=True)[1](out.last_hidden_state[0, -1])


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="checkpoints/smollm2-135m-specdecpp")
    ap.add_argument("--repeats", type=int, default=70)
    ap.add_argument("--draft_weights", choices=["bundle", "bf16"], default="bundle")
    ap.add_argument("--output", default="eval_out/draft_compile.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    bundle = SpecDecPP.from_pretrained(args.bundle)
    draft = bundle.draft
    if args.draft_weights == "bf16":
        draft = load_model({**bundle.draft_spec.to_dict(), "quantize": None})
    target, draft = bundle.target, draft.bind(bundle.target)
    dtype = draft.decoder.norm.weight.dtype
    prompt = torch.tensor([chat_prompt_ids(bundle.tokenizer, DEFAULT_PROMPTS[0])])
    ids = target.generate(prompt, max_new_tokens=64, do_sample=False)
    features = target(input_ids=ids, output_hidden_states=True).hidden_states[-1][0].to(dtype)
    n = ids.shape[1]
    target_cache = DynamicCache()
    target(input_ids=ids[:, :-1], **cache_kwargs(target, target_cache))
    context = target_cache.get_seq_length()
    dynamic = DynamicCache()  # both draft caches hold the prompt read with the target's features
    draft(features[None, :-1], ids[:, 1:], dynamic, position_ids=torch.arange(n - 1)[None], use_cache=True)
    static = cache_kwargs(draft.decoder, StaticCache(config=draft.decoder.config, max_cache_len=256))
    static_step(draft, static, features[None, :-1], ids[:, 1:], torch.arange(n - 1))
    base, feature, token = dynamic.get_seq_length(), features[-1], torch.tensor([[123]])
    compiled = torch.compile(static_step, dynamic=False, backend=backend(INDUCTOR_OPTIONS))

    def run(kind: str) -> torch.Tensor:
        if kind == "eager":
            logits = draft.support_logits(draft.step(feature, 123, dynamic, base))[1]
            crop_cache(dynamic, base)
            return logits
        step = compiled if kind == "compiled" else static_step
        return step(draft, static, feature[None, None], token, torch.tensor([base]))

    reference = run("eager")
    began = time.perf_counter()
    run("compiled")
    compile_s = time.perf_counter() - began
    differences = {kind: (run(kind).float() - reference.float()).abs().max().item() for kind in ("static", "compiled")}
    times: dict[str, list[float]] = {"eager": [], "static": [], "compiled": [], "target": []}
    for i in range(args.repeats + 10):
        for kind in ("eager", "static", "compiled"):
            t0 = time.perf_counter()
            target(input_ids=token, **cache_kwargs(target, target_cache), logits_to_keep=1)
            crop_cache(target_cache, context)
            t1 = time.perf_counter()
            run(kind)
            if i >= 10:  # warm-up
                times[kind].append((time.perf_counter() - t1) * 1e3)
                times["target"].append((t1 - t0) * 1e3)
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    result = {
        "machine": machine_info(),
        "bundle": args.bundle,
        "draft_weights": args.draft_weights,
        "repeats": args.repeats,
        "compile_s": compile_s,
        "max_logit_difference_vs_eager": differences,
        "median_ms": medians,
        "c": {kind: medians[kind] / medians["target"] for kind in ("eager", "static", "compiled")},
    }
    for kind, value in medians.items():
        print(f"{kind:>9}: {value:.3f} ms" + ("" if kind == "target" else f"  c = {result['c'][kind]:.3f}"))
    print(f"compile {compile_s:.1f} s; max |logit − eager| {differences}")
    write_json(args.output, result)


if __name__ == "__main__":
    main()
