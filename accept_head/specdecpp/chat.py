"""``python -m accept_head chat|overhead``: a terminal chat on a bundle, and the cost of going through ``generate``.

``chat`` streams each answer as its tokens are accepted (a transformers ``TextStreamer`` on
``target.generate(custom_generate=...)``; on a terminal a live status of tokens/s and tokens per round follows the
text while it streams), then prints the answer's tokens/s, the mean number of candidates accepted
per round and the speed-up over a plain ``target.generate`` pass on the same prompt, timed the same way.
``--prompt`` runs one turn and exits (scripts, tests); without it the chat reads turns from stdin until EOF or
``/exit``. ``--tree`` decodes with a draft tree grown by the head (the bundle's :meth:`SpecDecPP.tree_rule` through
the same ``custom_generate`` path, so it streams and takes ``--repetition_penalty`` too) and the statistics line gives
the tokens per round (per target call) and the mean tree size (candidates verified per call). ``--context_row``
sets how many tokens copied from the text join each chain or tree (default: the bundle's own; 0: none).

``overhead`` times the same greedy generations through ``speculative_generate`` directly and through
``target.generate(custom_generate=specdec.custom_generate)``, paired and interleaved, and prints the median relative
overhead over pairs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from typing import TextIO

import torch
from transformers import TextStreamer

from ..chain.baselines import ConfidenceThreshold, EntropyStop, Heuristic, PathConfidenceStop
from ..chain.decoding import speculative_generate
from ..chain.policies import FixedK, StopPolicy
from ..core.timing import device_timer
from .bundle import SpecDecPP
from .hf_generate import make_custom_generate

POLICIES = "head[:h], fixed:K, heuristic[:K0], confidence[:tau], entropy[:lambda], path[:h]"

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the sum of a list of numbers.",
    "Explain in two sentences why the sky is blue.",
)


def parse_policy(text: str, specdec: SpecDecPP) -> StopPolicy:
    """A stop policy from ``--policy`` (one of :data:`POLICIES`); ``head`` is the bundle's own head and h*."""
    name, _, arg = text.partition(":")
    try:
        if name == "head":
            return specdec.policy(float(arg) if arg else None)
        if name == "fixed":
            return FixedK(int(arg))
        if name == "heuristic":
            return Heuristic(int(arg) if arg else 5, persistent=False)
        if name == "confidence":
            return ConfidenceThreshold(float(arg) if arg else 0.4)
        if name == "entropy":
            return EntropyStop(float(arg) if arg else 0.5)
        if name == "path":
            return PathConfidenceStop(float(arg) if arg else 0.8)
    except ValueError as err:
        raise ValueError(f"--policy {text!r}: {err}") from None
    raise ValueError(f"--policy {text!r} is not one of {POLICIES}.")


def generation_kwargs(args: argparse.Namespace, specdec: SpecDecPP) -> dict:
    """``generate`` keyword arguments shared by the SpecDec++ and the autoregressive pass."""
    temperature = specdec.temperature if args.temperature is None else args.temperature
    kwargs: dict = {"max_new_tokens": args.max_new_tokens, "do_sample": temperature > 0}
    if temperature > 0:
        kwargs.update(temperature=temperature, top_p=args.top_p, top_k=args.top_k)
    if args.repetition_penalty is not None:
        kwargs["repetition_penalty"] = args.repetition_penalty
    tokenizer = specdec.tokenizer
    if tokenizer is not None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        kwargs.update(pad_token_id=pad, eos_token_id=specdec.eos_token_ids)
    return kwargs


class LiveStreamer(TextStreamer):
    """A ``TextStreamer`` that writes to ``out`` and, on a terminal, keeps a live status after the streamed text.

    ``put`` is called once per speculative round with the tokens just accepted. On a TTY the streamer writes the
    running tokens/s and tokens per round (dimmed) after the text, and erases it (ANSI save/restore cursor, clear to
    end of screen) before the next chunk, so the answer itself is never interleaved with statistics. Elsewhere
    (pipes, files, tests) it writes the text alone.
    """

    def __init__(self, tokenizer, out: TextIO) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.out = out
        self.live = bool(getattr(out, "isatty", lambda: False)())
        self.tokens = self.rounds = 0
        self.start: float | None = None
        self._status_shown = False

    def put(self, value: torch.Tensor) -> None:
        if self.next_tokens_are_prompt:  # generate streams the prompt first; the clock starts after it
            self.start = time.perf_counter()
        else:
            self.tokens += int(value.numel())
            self.rounds += 1
        super().put(value)
        if self.live and self.rounds:
            seconds = time.perf_counter() - (self.start or time.perf_counter())
            rate = self.tokens / seconds if seconds > 0 else 0.0
            self._clear_status()
            self.out.write(f"\x1b7\x1b[2m  [{rate:.1f} tok/s · {self.tokens / self.rounds:.2f} tok/round]\x1b[0m")
            self._status_shown = True
            self.out.flush()

    def _clear_status(self) -> None:
        if self._status_shown:
            self.out.write("\x1b8\x1b[J")
            self._status_shown = False

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self._clear_status()
        self.out.write(text + ("\n" if stream_end else ""))
        self.out.flush()


def _timed_generate(target: torch.nn.Module, input_ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, float]:
    with device_timer(next(target.parameters()).device) as watch:
        out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    return out, watch.seconds


def _against_autoregressive(
    specdec: SpecDecPP, input_ids: torch.Tensor, args: argparse.Namespace, sequences: torch.Tensor, speed: float
) -> str:
    """The statistics line's tail: the target's own ``generate`` on the same prompt and settings (same seed), its
    tok/s, the speed-up of ``speed`` over it and, when greedy, whether the tokens are the same as ``sequences``."""
    kwargs = generation_kwargs(args, specdec)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    plain, plain_seconds = _timed_generate(specdec.target, input_ids, **kwargs)
    plain_tps = (plain.shape[1] - input_ids.shape[1]) / plain_seconds
    tail = f" · autoregressive {plain_tps:.1f} tok/s → {speed / plain_tps:.2f}×"
    if not kwargs["do_sample"]:
        tail += " (same tokens)" if torch.equal(plain, sequences) else " (TOKENS DIFFER)"
    return tail


def answer(specdec: SpecDecPP, messages: list[dict], policy: StopPolicy, args: argparse.Namespace, out: TextIO) -> str:
    """Stream one answer to ``out`` and print its statistics line; returns the answer's text. With ``args.tree`` the
    rounds draft trees grown by the bundle's head (:meth:`SpecDecPP.tree_rule`) instead of ``policy``'s chains."""
    tokenizer = specdec.tokenizer
    input_ids = torch.tensor([specdec.encode(messages)])
    kwargs = generation_kwargs(args, specdec)
    if args.tree and args.policy != "head":
        raise ValueError(f"--tree grows trees with the bundle's head; drop --policy {args.policy} or drop --tree.")
    chains = None if args.tree else policy  # the tree is the bundle's; chains are the chosen policy's
    rule = specdec.decoding_rule(args.tree, greedy=not kwargs["do_sample"], context_row=args.context_row, policy=chains)
    fn = make_custom_generate(specdec.draft, rule)
    streamer = LiveStreamer(tokenizer, out)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    sequences, seconds = _timed_generate(specdec.target, input_ids, custom_generate=fn, streamer=streamer, **kwargs)
    stats = fn.last_stats
    new = sequences[0, input_ids.shape[1] :]
    line = f"[{len(new)} tokens in {seconds:.2f} s: {len(new) / seconds:.1f} tok/s · "
    if args.tree:
        line += (
            f"{stats.generated / max(stats.target_calls, 1):.2f} tokens/round · tree of "
            f"{statistics.fmean(stats.fed or [1]) - 1:.1f} candidates/round · {rule.describe()}"
        )
    else:
        line += (
            f"{stats.mean_accepted:.2f} accepted/round of {statistics.fmean(stats.proposed or [0]):.2f} drafted · "
            f"{rule.describe()}"
        )
    if not args.no_baseline:
        line += _against_autoregressive(specdec, input_ids, args, sequences, len(new) / seconds)
    out.write(line + "]\n")
    out.flush()
    return tokenizer.decode(new, skip_special_tokens=True)


def chat(args: argparse.Namespace, out: TextIO = sys.stdout, inp: TextIO = sys.stdin) -> int:
    specdec = SpecDecPP.from_pretrained(args.bundle, device=args.device, dtype=args.dtype)
    if specdec.tokenizer is None:
        raise SystemExit(f"{args.bundle} names no tokenizer (its target spec); chat needs one.")
    policy = parse_policy(args.policy, specdec)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt is None:
        out.write(f"SpecDec++ chat on {args.bundle} ({policy.describe()}); /exit or Ctrl-D to quit.\n")
    for text in [args.prompt] if args.prompt is not None else _read_turns(out, inp):
        messages.append({"role": "user", "content": text})
        reply = answer(specdec, messages, policy, args, out)
        messages.append({"role": "assistant", "content": reply})
    return 0


def _read_turns(out: TextIO, inp: TextIO) -> Iterator[str]:
    """The user's non-empty lines from ``inp``, each after a ``you>`` prompt, until EOF or ``/exit``."""
    while True:
        out.write("you> ")
        out.flush()
        text = inp.readline()
        if not text or text.strip() == "/exit":
            return
        if text.strip():
            yield text.strip()


def overhead(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Greedy generations through ``speculative_generate`` and through ``generate``, paired and interleaved.

    Each (prompt, repeat) runs both paths back to back, alternating which goes first so neither always meets a warm or
    a cold cache; the overhead is the median over pairs of (time through ``generate``) / (time direct) - 1, printed
    with its interquartile range. Both paths must produce the same tokens (checked for every pair).
    """
    specdec = SpecDecPP.from_pretrained(args.bundle, device=args.device, dtype=args.dtype)
    policy = parse_policy(args.policy, specdec)
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    eos = specdec.eos_token_ids

    def direct(ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        with device_timer(next(specdec.target.parameters()).device) as watch:
            ref = speculative_generate(
                specdec.target, specdec.draft, ids, policy, args.max_new_tokens, temperature=0, eos_token_id=eos
            )
        return ref.sequences, watch.seconds

    def through(ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        return _timed_generate(
            specdec.target,
            ids,
            custom_generate=specdec.custom_generate,
            policy=policy,
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else None,
        )

    ratios, times = [], {"direct": [], "generate": []}
    for repeat in range(args.repeats):
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([specdec.encode(prompt)])
            order = [("direct", direct), ("generate", through)]
            if (repeat + i) % 2:
                order.reverse()
            results = {name: fn(ids) for name, fn in order}
            (a_seq, a), (b_seq, b) = results["direct"], results["generate"]
            if not torch.equal(b_seq.cpu(), a_seq.cpu()):
                raise RuntimeError(f"generate(custom_generate=...) and speculative_generate differ on {prompt!r}")
            times["direct"].append(a)
            times["generate"].append(b)
            ratios.append(b / a)
    q1, med, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    out.write(
        f"speculative_generate median {statistics.median(times['direct']) * 1e3:.1f} ms, "
        f"generate(custom_generate=...) median {statistics.median(times['generate']) * 1e3:.1f} ms per generation; "
        f"paired overhead over {len(ratios)} pairs: median {100 * (med - 1):+.1f}% "
        f"(IQR {100 * (q1 - 1):+.1f}% .. {100 * (q3 - 1):+.1f}%), same tokens on every pair\n"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m accept_head", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("chat", "terminal chat streaming SpecDec++ answers"), ("overhead", "generate overhead")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--bundle", required=True, help="SpecDecPP bundle folder")
        p.add_argument("--policy", default="head", help=f"stop policy: {POLICIES} (default: the bundle's head)")
        p.add_argument("--max_new_tokens", type=int, default=256 if name == "chat" else 64)
        p.add_argument("--device", default=None, help="override the bundle's device (e.g. cuda:0)")
        p.add_argument("--dtype", default=None, help="override the bundle's dtype (float32, bfloat16, auto, ...)")
        p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
        if name == "chat":
            p.add_argument("--prompt", default=None, help="run this one turn and exit (non-interactive)")
            p.add_argument("--system", default=None, help="system prompt")
            p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the bundle's)")
            p.add_argument("--top_p", type=float, default=None)
            p.add_argument("--top_k", type=int, default=None)
            p.add_argument("--repetition_penalty", type=float, default=None)
            p.add_argument("--seed", type=int, default=None)
            p.add_argument("--no_baseline", action="store_true", help="skip the autoregressive comparison pass")
            p.add_argument("--tree", action="store_true", help="draft a token tree grown by the head each round")
            p.add_argument(
                "--context_row", type=int, default=None, help="tokens copied from the text per row (default: bundle's)"
            )
        else:
            p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
            p.add_argument("--repeats", type=int, default=3)
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout, inp: TextIO = sys.stdin) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        if args.command == "chat":
            return chat(args, out, inp)
        return overhead(args, out)
    except (ValueError, FileNotFoundError) as err:  # bad options, a missing or broken bundle: one line
        parser.error(str(err))
    return 2
