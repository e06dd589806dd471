"""The distribution check shared by the losslessness tests, and its negative controls.

:func:`goodness_of_fit` is a χ² test of sampled outcomes against probabilities computed exactly from a model
(:func:`exact_joint` for a small-vocabulary model; :func:`sampled_tokens` draws the seeded runs and
:func:`pair_p_values` tests their token pairs); the broken verifiers below are drop-in replacements for
:func:`accept_head.chain.decoding.verify` (or :func:`accept_head.trees.verify.verify_sampled`) that a correct check must
reject, so a test that passes with the real verifier and fails with these says something about the decoder.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from scipy.stats import chisquare
from transformers import LogitsProcessorList

from accept_head.chain.decoding import GenerationResult
from accept_head.chain.decoding import verify as correct_verify
from accept_head.core.sampling import SamplingConfig, probabilities, sample

ALPHA = 1e-3
"""A correct decoder passes at this level; the seeds are fixed, so the outcome is deterministic."""


def goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """χ² p-value of observed ``counts`` against exact ``probs`` (same shape); 0 if an impossible outcome occurred.

    Cells whose expected count is below 5 are pooled into one, as the χ² approximation requires. ``probs`` is
    renormalised in float64, so a float32 table that sums to 1 only up to rounding is fine.
    """
    observed, probs = counts.flatten().double(), probs.flatten().double()
    probs = probs / probs.sum()
    if observed[probs == 0].sum() > 0:
        return 0.0
    expected = probs * observed.sum()
    large = expected >= 5
    observed = torch.cat([observed[large], observed[~large & (probs > 0)].sum()[None]])
    expected = torch.cat([expected[large], expected[~large & (probs > 0)].sum()[None]])
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


@torch.inference_mode()
def exact_joint(
    model: torch.nn.Module, prompt: Sequence[int], new_tokens: int, processors: LogitsProcessorList | None = None
) -> torch.Tensor:
    """P(first ``new_tokens`` tokens) when sampling from ``model`` alone at temperature 1 after ``prompt``: a
    (V,)*new_tokens float64 tensor, enumerated over every prefix (keep V and ``new_tokens`` small). With
    ``processors``, HF's sampling distribution softmax(Φ_context(logits)) at every step instead."""
    vocab = int(model.config.vocab_size)
    joint = torch.ones((), dtype=torch.float64)
    for n in range(new_tokens):
        prefixes = torch.tensor([list(prompt) + list(p) for p in itertools.product(range(vocab), repeat=n)])
        logits = model(input_ids=prefixes).logits[:, -1].float()
        if processors is not None:
            logits = processors(prefixes, logits)
        steps = probabilities(logits, SamplingConfig(1.0)).double()
        joint = joint[..., None] * steps.view(*([vocab] * n), vocab)
    return joint


def sampled_tokens(
    decode: Callable[[torch.Generator], GenerationResult], samples: int, prompt_length: int, seed: int = 1234
) -> tuple[torch.Tensor, float]:
    """Run ``decode(generator)`` ``samples`` times on one seeded generator. Returns the generated tokens
    (samples, new tokens) and the fraction of runs in which at least one drafted or guessed token was accepted."""
    generator = torch.Generator().manual_seed(seed)
    tokens, hits = [], 0
    for _ in range(samples):
        result = decode(generator)
        tokens.append(result.sequences[0, prompt_length:])
        hits += sum(result.stats.accepted) > 0
    return torch.stack(tokens), hits / samples


def pair_p_values(tokens: torch.Tensor, joint: torch.Tensor) -> tuple[float, float]:
    """:func:`goodness_of_fit` p-values of the (token 1, token 2) and (token 3, token 4) pair counts of ``tokens``
    (S, 4) against the pair marginals of the exact ``joint`` (V, V, V, V)."""
    vocab = joint.shape[0]
    first = torch.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab**2)
    second = torch.bincount(tokens[:, 2] * vocab + tokens[:, 3], minlength=vocab**2)
    return goodness_of_fit(first, joint.sum(dim=(2, 3))), goodness_of_fit(second, joint.sum(dim=(0, 1)))


def accept_every_candidate(p, q, candidates, generator):
    """A broken verifier: keeps all K candidates and samples the bonus token (the output follows the draft)."""
    k = candidates.shape[0]
    return k, int(sample(p[k : k + 1], generator)[0])


def accept_first_guess(probs, rows, nodes, generator):
    """A broken tree verifier (a drop-in for :func:`accept_head.trees.verify.verify_sampled`): accepts the first row's
    first token whatever its probability, then draws the next token after it (the output follows the guesses)."""
    if not rows:
        return -1, 0, int(sample(probs[0][None], generator)[0])
    return 0, 1, int(sample(probs[nodes[0][0]][None], generator)[0])


def resample_from_target_on_rejection(p, q, candidates, generator):
    """A subtly broken verifier: right acceptance test, but it redraws from p instead of Norm[(p − q)+]."""
    m, _ = correct_verify(p, q, candidates, generator)
    return m, int(sample(p[m : m + 1], generator)[0])


SMALL_PROMPT = [0, 3, 5, 0, 3, 5, 0]
"""The prompt of the small-vocabulary distribution tests."""


def small_vocab_pair() -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """A vocabulary-8 Llama target, a noisy copy as draft, and the target's exact joint over 4 tokens after
    :data:`SMALL_PROMPT` (the χ² tests of tree and static-cache decoding)."""
    from tiny_models import perturbed_copy, small_vocab_llama

    target = small_vocab_llama(seed=0)
    return target, perturbed_copy(target, relative_noise=0.3, seed=1), exact_joint(target, SMALL_PROMPT, 4)
