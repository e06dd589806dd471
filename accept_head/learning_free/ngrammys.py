"""N-Grammys: learning-free batched speculation (Stewart et al., "The N-Grammys: Accelerating Autoregressive
Inference with Learning-Free Batched Speculation", 2024).

Each round guesses up to ``k`` rows of up to ``w`` tokens that could follow the committed text, verifies all of them
in ONE target call and keeps the longest accepted row plus the target's own next token. Guesses come from

- the *model bigram*: the target's top next tokens after every single vocabulary token, computed once
  in batches (:class:`ModelBigram`, cached on disk as safetensors keyed by the model's fingerprint); row r starts
  with the r-th most likely successor of the last token and is extended to w tokens by following each token's top-1
  successor through the table (the paper's extension to w > 1);
- *context n-grams* (:class:`~accept_head.trees.context.ContextNgrams`): the last q tokens are looked up among
  earlier positions of the prompt and output, and the w tokens that followed each match (most recent first) become rows;
- the *mixed* strategy: context rows first, then model-bigram rows until there are k.

The rows share the committed prefix's KV cache and the last token as their root: they are laid out as one token
tree under a custom 4D attention mask (:mod:`~accept_head.trees.verify`, public transformers API
``forward(attention_mask=<4D>, position_ids=..., cache=DynamicCache)``). Greedy verification accepts a
row while its tokens equal the target's argmax (the paper's rule). Beyond the paper, temperature > 0 verifies the
rows by Lookahead decoding's multi-candidate sample verification (:func:`~accept_head.trees.verify.verify_sampled`),
which keeps the output distribution exactly the target's. Rows are not merged into a trie: each row costs its
length, as in the paper's batched rows. Batch size 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..chain.decoding import GenerationResult, _check_int, _prepare, _timed, _until_eos
from ..core.sampling import SamplingConfig, argmax, probabilities
from ..models.feature_draft import model_fingerprint
from ..trees.attention import check_masked_attention
from ..trees.context import ContextNgrams
from ..trees.verify import (
    RowOrigin,
    RowStop,
    TreeDecodeStats,
    add_rows,
    apply_stop,
    commit_nodes,
    prefill_root,
    tree_forward,
    verify_greedy,
    verify_sampled,
)

STRATEGIES = ("model", "context", "mixed")
BIGRAM_FORMAT = "accept_head.ngrammys.bigram/1"


class ModelBigram:
    """The model-derived bigram table: ``next_tokens[t]`` (top,) are the target's ``top`` most likely next tokens
    after the one-token context ``[t]``, most likely first.

    ``next_tokens``: (V, top) LongTensor. ``fingerprint``: :func:`~accept_head.models.feature_draft.model_fingerprint`
    of
    the model it was computed from. That fingerprint covers the vocabulary, the width and the token embeddings, so it
    tells other models and tokenizers apart but not a fine-tune that kept the embeddings: rebuild the table after
    changing other weights (a stale table costs speed, never correctness — verification is by the target).
    """

    def __init__(self, next_tokens: torch.Tensor, fingerprint: str) -> None:
        if next_tokens.ndim != 2 or next_tokens.shape[1] < 1:
            raise ValueError(f"next_tokens must be (vocab_size, top >= 1); got {tuple(next_tokens.shape)}.")
        self.next_tokens = next_tokens.long().cpu()
        self.fingerprint = fingerprint
        self._checked: int | None = None  # id() of the last model that passed check()

    @property
    def vocab_size(self) -> int:
        return self.next_tokens.shape[0]

    @property
    def top(self) -> int:
        return self.next_tokens.shape[1]

    @classmethod
    @torch.inference_mode()
    def build(cls, model: torch.nn.Module, top: int = 32, batch_size: int = 512) -> ModelBigram:
        """Run every vocabulary token through ``model`` as a one-token context, ``batch_size`` at a time (V / batch
        forward passes of shape (batch, 1)), and keep the ``top`` most likely next tokens of each."""
        vocab = int(model.config.vocab_size)
        if not 1 <= top <= vocab:
            raise ValueError(f"top={top} must be in [1, vocab_size={vocab}].")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1.")
        device = next(model.parameters()).device
        rows = []
        for start in range(0, vocab, batch_size):
            ids = torch.arange(start, min(start + batch_size, vocab), device=device)[:, None]
            logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()
            rows.append(logits.topk(top, dim=-1).indices.cpu())
        return cls(torch.cat(rows), model_fingerprint(model))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        metadata = {"format": BIGRAM_FORMAT, "fingerprint": self.fingerprint, "vocab_size": str(self.vocab_size)}
        save_file({"next_tokens": self.next_tokens.contiguous()}, str(path), metadata=metadata)
        return path

    @classmethod
    def load(cls, path: str | Path, model: torch.nn.Module | None = None) -> ModelBigram:
        """Read a table written by :meth:`save`; with ``model``, refuse one computed from another model/tokenizer."""
        from safetensors import safe_open

        path = Path(path)
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        if metadata.get("format") != BIGRAM_FORMAT:
            raise ValueError(f"{path} is not a model-bigram table (format {metadata.get('format')!r}).")
        table = cls(load_file(str(path))["next_tokens"], metadata["fingerprint"])
        if model is not None:
            table.check(model, source=str(path))
        return table

    @classmethod
    def load_or_build(
        cls, model: torch.nn.Module, cache_dir: str | Path, top: int = 32, batch_size: int = 512
    ) -> ModelBigram:
        """The table for ``model`` from ``cache_dir/bigram-<fingerprint>-top<top>.safetensors``, computed and
        written there first if absent."""
        path = Path(cache_dir) / f"bigram-{model_fingerprint(model)}-top{top}.safetensors"
        if path.exists():
            return cls.load(path, model)
        table = cls.build(model, top, batch_size)
        table.save(path)
        return table

    def check(self, model: torch.nn.Module, source: str = "the bigram table") -> None:
        """Raise ValueError unless this table was computed from ``model`` (vocabulary size and fingerprint). A model
        object that passed is remembered (by ``id``), so its embeddings are hashed once, not on every call."""
        vocab = int(model.config.vocab_size)
        if self.vocab_size != vocab:
            raise ValueError(
                f"{source} covers a vocabulary of {self.vocab_size} tokens but the model's has {vocab}: it was "
                "computed for another model/tokenizer; rebuild it with ModelBigram.build(model)."
            )
        if self._checked == id(model):
            return
        fingerprint = model_fingerprint(model)
        if self.fingerprint != fingerprint:
            raise ValueError(
                f"{source} was computed from a model with fingerprint {self.fingerprint}, not this one "
                f"({fingerprint}); rebuild it with ModelBigram.build(model)."
            )
        self._checked = id(model)

    def rows(self, token: int, k: int, w: int) -> list[list[int]]:
        """k rows of w tokens after ``token``: row r starts with its r-th most likely successor and follows each
        token's top-1 successor (the greedy chain through the table). Returns a (k, w) nested list."""
        if k > self.top:
            raise ValueError(f"k={k} rows need a bigram table with top >= {k}; this one has top={self.top}.")
        chain = [self.next_tokens[token, :k]]
        for _ in range(w - 1):
            chain.append(self.next_tokens[chain[-1], 0])
        return torch.stack(chain, dim=1).tolist()


def check_ngrammys_params(k: int, w: int, q: int, strategy: str) -> None:
    for name, value in (("k", k), ("w", w), ("q", q)):
        _check_int(name, value)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}.")


def propose_rows(
    tokens: Sequence[int],
    k: int,
    w: int,
    strategy: str,
    context: ContextNgrams | None,
    bigram: ModelBigram | None,
) -> tuple[list[list[int]], list[RowOrigin]]:
    """The round's guesses: context rows first (strategies ``context`` / ``mixed``), then model-bigram rows not
    already present (``model`` / ``mixed``), at most k rows of at most w tokens. Returns (rows, their origins)."""
    matches = context.matches(tokens, k, w) if strategy != "model" else []
    rows = [row for _, row in matches]
    origins = [RowOrigin("context", rank, start) for rank, (start, _) in enumerate(matches)]
    if strategy != "context" and len(rows) < k:
        for rank, row in enumerate(bigram.rows(tokens[-1], k, w)):
            if row not in rows:
                rows.append(row)
                origins.append(RowOrigin("model", rank))
                if len(rows) == k:
                    break
    return rows, origins


@torch.inference_mode()
def ngrammys_generate(
    target: torch.nn.Module,
    input_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    *,
    k: int = 10,
    w: int = 4,
    q: int = 2,
    strategy: str = "mixed",
    bigram: ModelBigram | None = None,
    stop: RowStop | None = None,
) -> GenerationResult:
    """Lossless N-Grammys decoding: each round verifies up to ``k`` guessed rows of up to ``w`` tokens in one target
    call (see the module docstring). ``bigram`` (:meth:`ModelBigram.load_or_build`) is required by the ``model``
    and ``mixed`` strategies; ``q`` is the context n-gram query length. ``stop`` (a
    :class:`~accept_head.trees.verify.RowStop`, e.g. :class:`~accept_head.engine.free_stop.AdaptiveRowStop`) chooses how
    much of each guessed row to verify, and sees every verification pass; without it all rows are verified whole.
    Returns the sequences and :class:`~accept_head.trees.verify.TreeDecodeStats`."""
    check_ngrammys_params(k, w, q, strategy)
    sampling = SamplingConfig(temperature, top_k, top_p)
    if strategy != "context":
        if bigram is None:
            raise ValueError(
                f"strategy={strategy!r} needs the model bigram: pass bigram=ModelBigram.load_or_build(target, dir)."
            )
        bigram.check(target)  # hashes the embeddings once per model object
        if k > bigram.top:
            raise ValueError(f"k={k} rows need a bigram table with top >= {k}; this one has top={bigram.top}.")
    layout = check_masked_attention(target)
    ids, budget, eos = _prepare(input_ids, max_new_tokens, eos_token_id, target)
    stats = TreeDecodeStats()
    with _timed(stats, "total_time"):
        tokens = ids[0].tolist()
        context = ContextNgrams(q) if strategy != "model" else None
        if stop is not None:
            stop.start(tokens)
        with _timed(stats, "target_time"):
            cache = prefill_root(target, ids)  # lacks the last token: the next round's root
        while stats.generated < budget:
            # 1. Guess: rows may not outrun the budget (the target always adds a token of its own).
            with _timed(stats, "draft_time"):
                width = min(w, budget - stats.generated - 1)
                rows, origins = propose_rows(tokens, k, width, strategy, context, bigram) if width > 0 else ([], [])
                if stop is not None:
                    rows, origins = apply_stop(stop, tokens, rows, origins, fed=1)
            # 2. Verify every row in one pass over the tree [root = last token, row 1, ..., row k].
            with _timed(stats, "target_time"):
                tree, parents = [tokens[-1]], [-1]
                nodes = add_rows(tree, parents, 0, rows)
                logits = tree_forward(target, cache, tree, parents, layout=layout)
                if sampling.greedy:
                    row, m, next_token = verify_greedy(argmax(logits).tolist(), rows, nodes)
                else:
                    row, m, next_token = verify_sampled(probabilities(logits, sampling), rows, nodes, generator)
                commit_nodes(cache, len(tokens) - 1, nodes[row][:m] if m else [])
            if stop is not None:
                with _timed(stats, "draft_time"):
                    stop.observe(tokens, rows, origins, nodes, logits)
            # 3. Commit the winning row's accepted tokens and the target's own (up to an EOS).
            new = _until_eos([*rows[row][:m], next_token] if m else [next_token], eos)
            stats.record_tree_round(len(tree), len(rows), len(rows[row]) if row >= 0 else 0, m, len(new))
            tokens.extend(new)
            if new[-1] in eos:
                break
    return GenerationResult(torch.tensor([tokens], dtype=torch.long), stats)
