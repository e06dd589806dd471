"""Where a decoding round's time goes on this CPU, and what a static or compiled target buys (issue 37).

    python docs/experiments/cpu_decode_profile.py --bundle checkpoints/smollm2-135m-specdecpp \
        --output docs/experiments/cpu_decode_profile.json

Four measurements, bf16 (the bundle's dtype), each printed and written to ``--output`` with the machine:

1. **Pass widths.** One cached target pass of 1, 2, 4, 8, 16 tokens after a 128-token context: the model's own
   forward over a ``DynamicCache`` (eager), a :class:`~accept_head.models.static_target.StaticTarget` (static) and the
   same compiled (``torch.compile``, inductor; the compile time of each width is recorded). Medians of ``--repeats``.
2. **The LM head** alone (hidden → vocabulary logits) fed 1 and 2 rows.
3. **Autoregressive decoding** (the toolkit's ``autoregressive_generate``, greedy) with ``target_runtime`` eager,
   static and compiled, interleaved prompt by prompt, tokens/s.
4. **Round anatomy**: chain SpecDec++ and the head tree (``bundle.generate(tree=True)``), greedy, with forward hooks
   timing every target and draft forward: model time vs the rest, per round, and the rest split by what the
   decoders call (:data:`SPLIT`): drawing the candidates, verification, the target's cache and the tree masks, the
   acceptance head and its inputs, and what is left (the round loop, the stop rule, the drafter's bookkeeping around
   its forwards). On a CPU a host read (``int(t)``, ``t.tolist()``) waits for nothing: it is counted in the part
   that makes it. ``--round_runtimes eager,compiled`` adds chain rounds
   over a compiled target (and its copying chain, ``copies``): there the target's time is its
   :class:`~accept_head.models.static_target.StaticTarget` passes' (``forward``, ``tree_forward``) and the passes'
   widths are counted as fed and as padded. In every runtime the target's time includes each prompt's first pass,
   its prefill, which is also reported apart (``of_which_prefill``).

Prompts: the three built-in prompts of ``python -m accept_head chat`` (they choose nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from contextlib import ExitStack, contextmanager

import torch
from transformers import DynamicCache

from accept_head import autoregressive_generate
from accept_head.chain import decoding as chain_decoding
from accept_head.core.hf_compat import cache_kwargs, crop_cache
from accept_head.core.records import machine_info, write_json
from accept_head.models import static_target
from accept_head.models.static_target import StaticTarget
from accept_head.specdecpp.bundle import SpecDecPP
from accept_head.specdecpp.chat import DEFAULT_PROMPTS
from accept_head.trees import decoding as tree_decoding
from accept_head.trees import verify as tree_verify

WIDTHS = (1, 2, 4, 8, 16)


def median_ms(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)


def pass_widths(target, context: int, repeats: int, runtimes: list[str]) -> dict:
    """ms of one cached pass of each width after ``context`` tokens, per runtime; compile seconds per width."""
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 20000, (1, context), generator=generator)
    out: dict = {name: {} for name in runtimes}
    out["compile_s"] = {}
    for width in WIDTHS:
        ids = torch.randint(100, 20000, (1, width), generator=generator)
        for name in runtimes:
            if name == "eager":
                cache = DynamicCache()
                target(input_ids=prefix, **cache_kwargs(target, cache))

                def run(cache=cache, ids=ids):
                    target(input_ids=ids, **cache_kwargs(target, cache), logits_to_keep=0)
                    crop_cache(cache, context)

            else:
                static = StaticTarget(target, context + 32, compile=name == "compiled")
                static.forward(prefix)

                def run(static=static, ids=ids):
                    static.forward(ids)
                    static.crop(context)

                if name == "compiled":
                    began = time.perf_counter()
                    run()
                    out["compile_s"][width] = time.perf_counter() - began
            out[name][width] = median_ms(run, repeats)
        print(f"width {width:2d}: " + "  ".join(f"{n} {out[n][width]:.1f} ms" for n in runtimes), flush=True)
    return out


def lm_head_rows(target, repeats: int) -> dict:
    head = target.get_output_embeddings()
    hidden = torch.randn(2, head.in_features, dtype=head.weight.dtype)
    one = median_ms(lambda: head(hidden[:1]), repeats * 3)
    two = median_ms(lambda: head(hidden), repeats * 3)
    print(f"LM head: 1 row {one:.2f} ms, 2 rows {two:.2f} ms", flush=True)
    return {"rows_1_ms": one, "rows_2_ms": two}


def autoregressive(target, prompts: list[list[int]], tokens: int, repeats: int, runtimes: list[str]) -> dict:
    for name in runtimes:  # warm-up: compiles the compiled runtime's one-token pass
        autoregressive_generate(target, prompts[0], 4, temperature=0, target_runtime=name)
    seconds = {name: [] for name in runtimes}
    texts = {name: [] for name in runtimes}
    for _ in range(repeats):
        for ids in prompts:
            for name in runtimes:
                began = time.perf_counter()
                out = autoregressive_generate(target, ids, tokens, temperature=0, target_runtime=name)
                seconds[name].append(time.perf_counter() - began)
                texts[name].append(out.sequences[0].tolist())
    result = {}
    for name in runtimes:
        rates = [tokens / s for s in seconds[name]]
        same = sum(a == b for a, b in zip(texts[name], texts["eager"]))
        result[name] = {"tokens_per_second": statistics.median(rates), "same_as_eager": f"{same}/{len(rates)}"}
    base = result["eager"]["tokens_per_second"]
    for name in runtimes:
        result[name]["vs_eager"] = result[name]["tokens_per_second"] / base
        print(f"autoregressive {name}: {result[name]['tokens_per_second']:.1f} tok/s ({result[name]['vs_eager']:.2f}x)")
    return result


@contextmanager
def forward_clock(modules: dict[str, torch.nn.Module]):
    """Sum the wall time of every forward of each module (outermost calls only); ``spent["target_calls"]`` lists the
    target's calls' seconds in order."""
    spent = {name: 0.0 for name in modules} | {"target_calls": []}
    handles = []
    for name, module in modules.items():
        began: list[float] = []

        def pre(mod, args, began=began):
            began.append(time.perf_counter())

        def post(mod, args, output, began=began, name=name):
            start = began.pop()
            if not began:
                spent[name] += time.perf_counter() - start
                if name == "target":
                    spent["target_calls"].append(time.perf_counter() - start)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        yield spent
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def method_clock(owner: object, name: str, spent: dict, key: str):
    """Add the wall time of every call of ``owner.<name>`` to ``spent[key]``."""
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        began = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - began

    setattr(owner, name, timed)
    try:
        yield
    finally:
        delattr(owner, name)  # the instance attribute goes; the class's method shows through again


@contextmanager
def pass_clock(spent: dict, widths: list[int]):
    """Add the wall time of every :class:`StaticTarget` pass (``forward``, ``tree_forward``) to ``spent["target"]``
    and its seconds to ``spent["target_calls"]``, and record each pass's width (tokens fed) in ``widths``."""
    originals = {name: StaticTarget.__dict__[name] for name in ("forward", "tree_forward")}

    def clocked(original):
        def timed(self, ids, *args, **kwargs):
            began = time.perf_counter()
            try:
                return original(self, ids, *args, **kwargs)
            finally:
                spent["target"] += time.perf_counter() - began
                spent["target_calls"].append(time.perf_counter() - began)
                widths.append(ids.shape[1])

        return timed

    for name, original in originals.items():
        setattr(StaticTarget, name, clocked(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(StaticTarget, name, original)


SPLIT = {
    "draft_sampling": [(chain_decoding, "draw"), (tree_decoding, "draft_probs")],
    "verification": [
        (chain_decoding, "probabilities"),
        (chain_decoding, "verify"),
        (chain_decoding, "verify_argmax"),
        (tree_decoding, "verify_tree"),
    ],
    "cache_and_masks": [
        (chain_decoding, "_crop"),
        (tree_decoding, "tree_rows"),
        (tree_decoding, "commit_nodes"),
        (tree_verify, "tree_mask"),
        (tree_verify, "layer_masks"),
    ],
}
"""The parts of a round outside the models' forwards, each the functions the decoders call for it (module, name):
the draft's sampling transform and draw, the target's probabilities and the accept/reject step, and the target cache's
crop or kept positions with the tree's rows and attention masks."""


@contextmanager
def function_clock(spent: dict, split: dict = SPLIT):
    """Add the wall time of every call of each function of ``split`` to ``spent[part]``, counting only the outermost
    clocked call (``draw`` computes ``probabilities``: that is drawing, not verification)."""
    depth = [0]
    patched = []

    def clocked(original, part):
        def timed(*args, **kwargs):
            depth[0] += 1
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[part] += time.perf_counter() - began

        return timed

    for part, places in split.items():
        spent[part] = 0.0
        for module, name in places:
            original = getattr(module, name)
            patched.append((module, name, original))
            setattr(module, name, clocked(original, part))
    try:
        yield spent
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


ROUND_MODES = {
    "chain": {"tree": False, "context_row": 0},
    "tree": {"tree": True},
    "chain_copies": {"tree": False, "context_row": 4},
    "chain_copies_padding": {"tree": False, "context_row": 4, "padding_only": True},
}
"""The decoding modes the round anatomy times: chain SpecDec++ alone, the head tree (the bundle's tree settings), chain
SpecDec++ with four tokens copied from the text beside each chain, and with copies only where a static or compiled
target's pass pads anyway (``padding_only``)."""


def round_anatomy(bundle: SpecDecPP, prompts: list[list[int]], tokens: int, runtime: str = "eager") -> dict:
    """Per decoding mode (:data:`ROUND_MODES`; over a static or compiled target only the chains): model time vs the
    rest, per round (greedy), the rest split as :data:`SPLIT` and :func:`function_clock` do. The draft's forward
    includes its LM head, which the drafters call outside the module's ``forward`` (on the kept vocabulary), and a
    feature draft's drafting calls (``FeatureDraft.extend``: the lean layer calls no module's ``forward``). Over a
    static or compiled target the target's time is its passes' (the prompt's prefill included) and the passes' widths
    are recorded, fed and padded."""
    draft_module = bundle.draft
    result = {}
    modes = ROUND_MODES if runtime == "eager" else {k: v for k, v in ROUND_MODES.items() if not v["tree"]}
    for mode, options in modes.items():
        options = options | ({} if runtime == "eager" else {"target_runtime": runtime})
        for ids in prompts:  # warm-up: a compiled target compiles the widths these prompts' rounds use
            bundle.generate(ids, max_new_tokens=tokens, temperature=0, **options)
        total = rounds = generated = head = 0.0
        # The LM head over the kept ids, the module every drafter of this draft multiplies by.
        rows = draft_module.support_rows()[1] if hasattr(draft_module, "support_rows") else draft_module.lm_head
        modules = {"target": bundle.target, "draft": draft_module, "draft_head": rows}
        widths: list[int] = []
        decoding: list[int] = []  # the widths of the passes after each prompt's prefill
        prefill = 0.0  # seconds of each prompt's first target pass
        with forward_clock(modules) as spent, ExitStack() as stack:
            if hasattr(draft_module, "extend"):
                stack.enter_context(method_clock(draft_module, "extend", spent, "draft"))
            stack.enter_context(pass_clock(spent, widths))
            stack.enter_context(function_clock(spent))
            for ids in prompts:
                start, calls = len(widths), len(spent["target_calls"])
                began = time.perf_counter()
                out = bundle.generate(ids, max_new_tokens=tokens, temperature=0, **options)
                total += time.perf_counter() - began
                decoding += widths[start + 1 :]
                prefill += spent["target_calls"][calls]
                rounds += len(out.stats.accepted)
                generated += out.stats.generated
                head += out.stats.head_time
        draft = spent["draft"] + spent["draft_head"]
        other = total - spent["target"] - draft
        key = mode if runtime == "eager" else f"{mode}_{runtime}"
        result[key] = {
            "rounds": rounds,
            "tokens_per_round": generated / rounds,
            "tokens_per_second": generated / total,
            "ms_per_round": {
                "total": 1e3 * total / rounds,
                "target_forwards": 1e3 * spent["target"] / rounds,
                "of_which_prefill": 1e3 * prefill / rounds,
                "draft_forwards": 1e3 * draft / rounds,
                "of_which_draft_lm_head": 1e3 * spent["draft_head"] / rounds,
                "everything_else": 1e3 * other / rounds,
                "of_which_head_and_its_inputs": 1e3 * head / rounds,
                **{f"of_which_{part}": 1e3 * spent[part] / rounds for part in SPLIT},
                "of_which_the_rest": 1e3 * (other - head - sum(spent[part] for part in SPLIT)) / rounds,
            },
            "everything_else_share": other / total,
        }
        if decoding:
            result[key]["pass_widths"] = {
                "fed": dict(sorted(Counter(decoding).items())),
                "padded": dict(sorted(Counter(static_target.padded_width(w) for w in decoding).items())),
            }
        ms = result[key]["ms_per_round"]
        print(
            f"{key}: {rounds:.0f} rounds, {generated / rounds:.2f} tokens/round, {generated / total:.1f} tok/s, "
            f"{ms['total']:.1f} ms/round = target {ms['target_forwards']:.1f} (prefill {ms['of_which_prefill']:.1f}) + "
            f"draft {ms['draft_forwards']:.1f} "
            f"+ other {ms['everything_else']:.1f} ({100 * other / total:.1f}% other: "
            + ", ".join(f"{part} {ms['of_which_' + part]:.2f}" for part in ("head_and_its_inputs", *SPLIT, "the_rest"))
            + ")",
            flush=True,
        )
    return result


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", default="checkpoints/smollm2-135m-specdecpp")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--runtimes", default="eager,static,compiled")
    ap.add_argument("--round_runtimes", default="eager", help="the round anatomy's target runtimes: eager,compiled")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: widths,head,autoregressive,rounds")
    ap.add_argument("--output", default="eval_out/cpu_decode_profile.json")
    ap.add_argument("--inductor_options", default="default", help="JSON replacing the defaults, e.g. '{}'")
    args = ap.parse_args()
    if args.inductor_options != "default":
        static_target.INDUCTOR_OPTIONS.clear()
        static_target.INDUCTOR_OPTIONS.update(json.loads(args.inductor_options))
    runtimes, skip = args.runtimes.split(","), set(filter(None, args.skip.split(",")))
    bundle = SpecDecPP.from_pretrained(args.bundle)
    target = bundle.target
    prompts = [bundle.encode([{"role": "user", "content": p}]) for p in DEFAULT_PROMPTS]
    payload = {"machine": machine_info(), "bundle": args.bundle, "dtype": str(next(target.parameters()).dtype)}
    payload["settings"] = vars(args)
    if "rounds" not in skip:
        payload["rounds"] = {}
        for runtime in args.round_runtimes.split(","):
            payload["rounds"] |= round_anatomy(bundle, prompts, args.tokens, runtime)
    if "head" not in skip:
        payload["lm_head"] = lm_head_rows(target, args.repeats * 5)
    if "widths" not in skip:
        payload["pass_ms"] = pass_widths(target, args.context, args.repeats * 5, runtimes)
    if "autoregressive" not in skip:
        payload["autoregressive"] = autoregressive(target, prompts, args.tokens, args.repeats, runtimes)
    write_json(args.output, payload)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
