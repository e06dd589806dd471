"""Chain speculative decoding whose rounds also verify rows copied from the text: a chain with a second branch.

Each round the draft proposes its chain y_1..y_K as :func:`~accept_head.chain.decoding.speculative_generate` does
(the stop policy decides K), and two rows copied from the text itself join it
(:class:`~accept_head.trees.context.ContextRow`): one after the committed text (at the root) and one after the text
and the whole chain (below y_K). Where a copy holds the chain's own tokens it follows them, so a round is a chain
whenever the copies agree with the draft, and a two-branch tree otherwise. The target scores every node in one pass
under a tree mask (:func:`~accept_head.trees.verify.tree_forward`).

Why it stays exact. The copies are functions of the committed text and the drafted chain, fixed before verification.
Greedy verification accepts a node iff it is the target's argmax. At T > 0 the drafted y_i is accepted with
probability min(1, p/q) as a chain candidate is, and a copied token c is tried after it on what the rejection left of
p (probability r(c) / Σ r, else its mass removed) — recursive rejection sampling with a point-mass guess
(:func:`~accept_head.trees.verify.verify_recursive`), under which every emitted token follows the target's p.

Why: on the greedy rollout labels `make demo` writes, the committed draft's FixedK(4) rounds accept 1.43 tokens,
and with the two copies 1.95 (``docs/experiments/context_copies.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from ..chain.decoding import (
    GenerationResult,
    _check_int,
    _check_pair,
    _prepare,
    _timed,
    _until_eos,
    draft_room,
    draft_round,
    prefill,
)
from ..chain.policies import StopPolicy
from ..core.sampling import SamplingConfig
from ..models.drafters import as_drafter
from ..models.features import capture_lm_head_input
from .attention import attention_layout, check_masked_attention
from .context import ContextRow
from .decoding import add_copied_rows, tree_rows, verify_tree
from .growth import DraftTree, check_context_row
from .verify import TreeDecodeStats, commit_nodes, tree_forward


@torch.inference_mode()
def chain_copy_generate(
    target: torch.nn.Module,
    draft,
    input_ids: torch.Tensor | Sequence[int],
    policy: StopPolicy,
    max_new_tokens: int,
    context_row: int = 4,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Lossless speculative decoding with ``policy``'s chains plus up to ``context_row`` tokens copied from the text
    at the root and as many below the chain (see the module docstring).

    Takes :func:`~accept_head.chain.decoding.speculative_generate`'s arguments (the target eager: it must take a
    custom 4D attention mask, :func:`~accept_head.trees.attention.check_masked_attention`). Returns the sequences
    and :class:`~accept_head.trees.verify.TreeDecodeStats`: ``proposed`` / ``accepted`` count the winning row's
    tokens (drafted or copied), ``fed`` the tokens each target call read and ``rows`` the round's leaves;
    ``policy.update`` hears how many *drafted* candidates were accepted. ``context_row=0`` verifies the chain alone
    through the same tree pass (the control that prices the tree path).
    """
    _check_int("max_new_tokens", max_new_tokens, low=0)
    check_context_row(context_row)
    sampling = SamplingConfig(temperature, top_k, top_p)
    check_masked_attention(target)
    layout = attention_layout(target)
    drafter = as_drafter(draft, target, with_hidden=policy.uses_hidden)
    _check_pair(drafter, policy, sampling)
    ids, budget, eos = _prepare(input_ids, max_new_tokens, eos_token_id, target)
    device = next(target.parameters()).device
    stats, tokens = TreeDecodeStats(), ids[0].tolist()
    copy = ContextRow(context_row) if context_row else None
    policy.reset()
    draft_device = getattr(drafter, "device", None)
    with _timed(stats, "total_time", {device, draft_device or device}):
        cache = DynamicCache()  # the target's: it lacks the last committed token, each round's root
        with _timed(stats, "target_time", device):
            prefill(target, drafter, ids.to(device), cache)
        while stats.generated < budget:
            # 1. Draft the chain, then merge the copies: no path longer than the budget or the draft's context allow.
            depth = min(budget - stats.generated - 1, draft_room(drafter, len(tokens)))
            with _timed(stats, "draft_time", draft_device):
                limit = min(policy.max_candidates, depth)
                state, q_rows = draft_round(drafter, policy, sampling, limit, len(tokens), generator, stats)
                tree = chain_tree(state.candidates, q_rows, sampled=not sampling.greedy)
                nodes = list(range(len(state.candidates)))
                if copy is not None and depth > 0:
                    nodes = add_copied_rows(tree, nodes, copy, tokens, depth)
            # 2. Verify the root (the last token) and every node in one pass.
            with _timed(stats, "target_time", device):
                tree_tokens, parents, paths, rows = tree_rows(tree, nodes)
                with capture_lm_head_input(target) as box:
                    logits = tree_forward(target, cache, [tokens[-1], *tree_tokens], [-1, *parents], layout=layout)
                row, m, next_token = verify_tree(logits, tree, paths, rows, sampling, generator)
                accepted = paths[row][:m] if m else []
                commit_nodes(cache, len(tokens) - 1, rows[row][:m] if m else [])
            policy.update(state, sum(node < len(state.candidates) for node in accepted))  # chain nodes come first
            # 3. Commit the accepted path and the target's token (up to an EOS); the drafter keeps what it shares.
            new = _until_eos([*(tree.tokens[n] for n in accepted), next_token], eos)
            stats.record_tree_round(1 + len(nodes), len(paths), len(paths[row]) if row >= 0 else 0, m, len(new))
            with _timed(stats, "draft_time", draft_device):
                hidden = box[0][0, [0, *(rows[row][:m] if m else [])]] if drafter.needs_target_features else None
                drafter.commit(new, None if hidden is None else hidden[: len(new)])
            tokens.extend(new)
            if new[-1] in eos:
                break
    return GenerationResult(torch.tensor([tokens], dtype=torch.long), stats)


def chain_tree(candidates: Sequence[int], q_rows: Sequence[torch.Tensor], sampled: bool) -> DraftTree:
    """A drafted chain as a :class:`~accept_head.trees.growth.DraftTree`: node i holds y_{i+1} below node i − 1 (−1:
    the root), scored by its draft probability; with ``sampled`` (T > 0) each parent keeps the distribution q its
    child was drawn from, so :func:`~accept_head.trees.verify.verify_recursive` accepts it with min(1, p/q)."""
    tree = DraftTree(sampled=sampled)
    for i, (token, q) in enumerate(zip(candidates, q_rows)):
        prob = float(q[token])
        tree.add(token, i - 1, prob, prob)
        if sampled:
            tree.dists[i - 1] = q
    return tree
