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
from dataclasses import dataclass

import torch

from ..chain.decoding import GenerationResult, _check_int, _check_pair, draft_round
from ..chain.policies import RoundState, StopPolicy
from ..core.sampling import SamplingConfig
from ..models.drafters import Drafter, as_drafter
from ..models.static_target import WIDTHS, padded_width
from .attention import check_masked_attention
from .context import LONG_MATCH, ContextRow
from .decoding import add_copied_rows, decode_rounds
from .growth import DraftTree, check_context_row
from .verify import TreeDecodeStats


@dataclass
class CopyingChain:
    """A stop ``policy``'s chains with up to ``context_row`` tokens copied from the text beside each (the module
    docstring): what :func:`chain_copy_generate` decodes, and what ``make_custom_generate`` takes in place of a stop
    policy or a tree rule to run it inside ``model.generate``.

    ``long_row`` (opt-in, 0: off): copy that many tokens instead where the recurring suffix is at least
    :data:`~accept_head.trees.context.LONG_MATCH` tokens long — text repeating a long stretch, as code does. On 40
    held-out prompts 16 took the default bundle's greedy rounds from 3.06 to 3.20 tokens and decoded HumanEval
    1.10–1.15× as fast, all four sources 1.01–1.03×, over the eager target; over the compiled one, whose passes pad to
    16 tokens, 0.96× (``docs/experiments/copy_length.py``; findings §8).

    ``padding_only`` (opt-in): copy only into the positions a static or compiled target computes anyway — its passes
    run at the smallest of :data:`~accept_head.models.static_target.WIDTHS` that holds the root and the chain — so the
    copies never widen a pass into a larger width (nor past 16 tokens). Over an eager target it caps the copies the
    same way."""

    policy: StopPolicy
    context_row: int = 4
    long_row: int = 0
    padding_only: bool = False

    def __post_init__(self) -> None:
        check_context_row(self.context_row)
        if isinstance(self.long_row, bool) or not isinstance(self.long_row, int) or self.long_row < 0:
            raise ValueError(
                f"long_row={self.long_row!r} must be an integer >= 0 (tokens copied after a long repeat; 0: off, "
                "e.g. 16)."
            )
        if not isinstance(self.padding_only, bool):
            raise ValueError(f"padding_only={self.padding_only!r} must be True or False.")

    def copied_rows(self) -> ContextRow | None:
        """The :class:`~accept_head.trees.context.ContextRow` of one sequence (None without copies)."""
        if not self.context_row:
            return None
        if self.long_row:  # a long row no longer than context_row changes nothing (ContextRow ignores it)
            return ContextRow(self.context_row, long_length=self.long_row, long_match=LONG_MATCH)
        return ContextRow(self.context_row)

    def drafter(self, draft, target: torch.nn.Module, sampling: SamplingConfig) -> Drafter:
        """The chain :class:`~accept_head.models.drafters.Drafter` for ``draft``, once ``target`` takes a tree mask and
        the policy suits the draft and the decoding mode."""
        check_masked_attention(target)
        drafter = as_drafter(draft, target, with_hidden=self.policy.uses_hidden)
        _check_pair(drafter, self.policy, sampling)
        return drafter

    def describe(self) -> str:
        long = f", long_row={self.long_row}" if self.long_row else ""
        padding = ", padding_only" if self.padding_only else ""
        return f"{self.policy.describe()} + copies (context_row={self.context_row}{long}{padding})"


class ChainRounds:
    """:func:`chain_copy_generate`'s rounds (:class:`~accept_head.trees.decoding.Rounds`): the policy's chain as a
    tree, the copies merged in; the policy hears how many *drafted* candidates were accepted."""

    def __init__(
        self,
        drafter: Drafter,
        chain: CopyingChain,
        sampling: SamplingConfig,
        stats: TreeDecodeStats,
        generator: torch.Generator | None,
    ) -> None:
        self.drafter, self.policy, self.sampling = drafter, chain.policy, sampling
        self.stats, self.generator = stats, generator
        self.copy, self.padding_only = chain.copied_rows(), chain.padding_only
        self.state = RoundState()
        self.policy.reset()

    def draft(self, tokens: list[int], depth: int) -> tuple[DraftTree, list[int]]:
        limit = min(self.policy.max_candidates, depth)
        copy_below = None
        if self.copy is not None:

            def copy_below(path: Sequence[int]) -> bool:  # the row add_copied_rows would hang below the chain
                return bool(self.copy(tokens, depth - len(path), path))

        self.state, q_rows = draft_round(
            self.drafter, self.policy, self.sampling, limit, len(tokens), self.generator, self.stats, copy_below
        )
        tree = chain_tree(self.state.candidates, q_rows, sampled=not self.sampling.greedy)
        nodes = list(range(self.state.n))
        if self.copy is not None and depth > 0:
            # A static target holds the budget and 16 positions more (decode_rounds): long copies stay within them.
            room = depth + WIDTHS[-1]
            if self.padding_only:  # the pass feeds the root and the nodes: fill its padded width, no more
                room = min(room, padded_width(1 + len(nodes)) - 1)
            nodes = add_copied_rows(tree, nodes, self.copy, tokens, depth, room=room)
        return tree, nodes

    def commit(self, tree: DraftTree, accepted: list[int], new: list[int], hidden: torch.Tensor | None) -> None:
        self.policy.update(self.state, sum(node < self.state.n for node in accepted))  # the chain's nodes come first
        self.drafter.commit(new, hidden)


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
    target_runtime: str = "eager",
    long_row: int = 0,
    padding_only: bool = False,
) -> GenerationResult:
    """Lossless speculative decoding with ``policy``'s chains plus up to ``context_row`` tokens copied from the text
    at the root and as many below the chain (see the module docstring; ``long_row``, ``padding_only``:
    :class:`CopyingChain`'s).

    Takes :func:`~accept_head.chain.decoding.speculative_generate`'s arguments (the target eager: it must take a
    custom 4D attention mask, :func:`~accept_head.trees.attention.check_masked_attention`). Returns the sequences
    and :class:`~accept_head.trees.verify.TreeDecodeStats`: ``proposed`` / ``accepted`` count the winning row's
    tokens (drafted or copied), ``fed`` the tokens each target call read and ``rows`` the round's leaves;
    ``policy.update`` hears how many *drafted* candidates were accepted. ``context_row=0`` verifies the chain alone
    through the same tree pass (the control that prices the tree path). ``target_runtime``: ``eager`` (the model's
    forward under a 4D mask), ``static`` or ``compiled`` (its preallocated cache, the tree pass compiled per padded
    width; :class:`~accept_head.models.static_target.StaticTarget`), as for
    :func:`~accept_head.chain.decoding.speculative_generate`.
    """
    _check_int("max_new_tokens", max_new_tokens, low=0)
    sampling = SamplingConfig(temperature, top_k, top_p)
    chain = CopyingChain(policy, context_row, long_row, padding_only)
    rounds = ChainRounds(chain.drafter(draft, target, sampling), chain, sampling, TreeDecodeStats(), generator)
    return decode_rounds(
        target, rounds, input_ids, max_new_tokens, sampling, eos_token_id, generator, target_runtime=target_runtime
    )


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
