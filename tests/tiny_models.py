"""Tiny, offline model pairs for tests: a word-level tokenizer with a chat template and random Llama models.

Import these helpers from any test module (``from tiny_models import ...``; pytest puts ``tests/`` on ``sys.path``).
Nothing here downloads anything, and model initialisation runs under ``torch.random.fork_rng`` so building a tiny
model never disturbs the global RNG of the test that calls it.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIAL_TOKENS = ["<pad>", "<unk>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]
"""Ids 0..6: pad, unk, bos, eos and the chat-role markers."""

WORDS = (
    "the a an of to and in is it that for on with as be this by at or from you we they he she not are was "
    "write code function return def if else for while print list sum number numbers two three add answer question "
    "story poem short long explain why how what when where which please give me python value true false one zero "
    "x y z = ( ) : , . ? ! + - * /"
).split()

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(folder: str | Path | None = None, extra_words: tuple[str, ...] = ()):
    """A ``PreTrainedTokenizerFast`` over :data:`WORDS` (whitespace / punctuation split, ``<unk>`` for the rest).

    ``extra_words`` grows the vocabulary (a different tokenizer, for mismatch tests). Saved to ``folder`` if given.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + WORDS + list(extra_words))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if folder is not None:
        tokenizer.save_pretrained(str(folder))
    return tokenizer


def make_llama(
    folder: str | Path | None = None,
    *,
    tokenizer=None,
    seed: int = 0,
    hidden_size: int = 32,
    num_layers: int = 2,
    init_range: float = 0.3,
    max_position_embeddings: int = 256,
):
    """A random ``LlamaForCausalLM`` (float32) over ``tokenizer``'s vocabulary, saved with its tokenizer to ``folder``.

    ``init_range`` well above Llama's 0.02 makes the next-token distributions peaked and the pair disagree, so
    acceptance labels spread over (0, 1] instead of all sitting near 1.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tokenizer if tokenizer is not None else make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_range,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    if folder is not None:
        model.save_pretrained(str(folder))
        tokenizer.save_pretrained(str(folder))
    return model


def make_pair(root: str | Path, *, target_seed: int = 0, draft_seed: int = 1) -> tuple[Path, Path]:
    """Save a tiny target (3 layers) and draft (1 layer) with a shared tokenizer under ``root``; return their folders."""
    root = Path(root)
    tokenizer = make_tokenizer()
    target, draft = root / "target", root / "draft"
    make_llama(target, tokenizer=tokenizer, seed=target_seed, num_layers=3)
    make_llama(draft, tokenizer=tokenizer, seed=draft_seed, num_layers=1, hidden_size=16)
    return target, draft
