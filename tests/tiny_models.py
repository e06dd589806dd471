"""Tiny, offline model pairs for tests: a word-level tokenizer with a chat template and random Llama models.

Import these helpers from any test module (``from tiny_models import ...``; pytest puts ``tests/`` on ``sys.path``).
Nothing here downloads anything, and model initialisation runs under ``torch.random.fork_rng`` so building a tiny
model never disturbs the global RNG of the test that calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    """Save a tiny target (3 layers) and draft (1 layer) sharing a tokenizer under ``root``; return their folders."""
    root = Path(root)
    tokenizer = make_tokenizer()
    target, draft = root / "target", root / "draft"
    make_llama(target, tokenizer=tokenizer, seed=target_seed, num_layers=3)
    make_llama(draft, tokenizer=tokenizer, seed=draft_seed, num_layers=1, hidden_size=16)
    return target, draft


def retrained_copy(folder: str | Path, copy: str | Path) -> Path:
    """A copy of the model folder ``folder`` at ``copy`` whose weights then change as a retraining in place would
    change them (one tensor of each safetensors file shifted), its config untouched."""
    import shutil

    from safetensors.torch import load_file, save_file

    copy = Path(shutil.copytree(folder, copy))
    for file in copy.glob("*.safetensors"):
        tensors = load_file(file)
        name = sorted(tensors)[0]
        tensors[name] = tensors[name] + 0.01
        save_file(tensors, file, metadata={"format": "pt"})
    return copy


def small_vocab_llama(seed: int = 0, vocab_size: int = 8):
    """A random float32 Llama over a vocabulary of ``vocab_size`` (2 layers, hidden size 16, peaked by
    ``initializer_range=0.5``): small enough to enumerate the distribution of its first few sampled tokens
    (``stats_helpers.exact_joint``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        initializer_range=0.5,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()


def near_bigram(model: torch.nn.Module, scale: float = 0.02) -> torch.nn.Module:
    """Shrink every attention output of a Llama in place (and return it): the next token then depends mostly on the
    current one, so bigram rows, context n-grams, Jacobi iterates and pool phrases are often right and the
    learning-free decoders exercise multi-token acceptance."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(scale)
    return model


def perturbed_copy(model: torch.nn.Module, relative_noise: float = 0.3, seed: int = 0) -> torch.nn.Module:
    """A copy of ``model`` with Gaussian noise of ``relative_noise`` × each weight tensor's std added to it.

    As a draft for ``model`` it proposes the target's token often but not always, so decoding exercises both the
    accept and the reject path. The noise is drawn on the CPU, so a model on any device gets the same copy.
    """
    import copy

    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in noisy.parameters():
            scale = float(param.std()) if param.numel() > 1 else 0.0
            noise = torch.randn(param.shape, generator=generator) * relative_noise * scale
            param.add_(noise.to(device=param.device, dtype=param.dtype))
    return noisy


class TableLM(torch.nn.Module):
    """A stub causal LM with fixed logits: the logits after input token ``t`` at position ``i`` are ``table[i, t]``.

    It behaves like an HF model where the decoders need it to: ``.config`` (vocab_size, hidden_size,
    max_position_embeddings), ``get_output_embeddings()`` returning the ``nn.Linear`` whose input is the final hidden
    state, and ``forward(input_ids, past_key_values, use_cache, logits_to_keep)`` that appends one position per input
    token to a real ``DynamicCache``. The cached "keys" hold the token ids, so :meth:`cached_tokens` shows exactly
    what a cache contains after the decoder's crops.

    The hidden state at (i, t) is the one-hot vector of index ``i * V + t`` (hidden size ``P * V``) and the output
    layer's weight is the table, so the logits are exact copies of table entries and a depth-0 acceptance head can
    assign any probability to any (position, token).

    Counters: ``calls`` (forward passes) and ``fed`` (the number of input tokens of each pass).
    """

    def __init__(self, table: torch.Tensor) -> None:
        from types import SimpleNamespace

        super().__init__()
        positions, vocab, vocab_out = table.shape
        assert vocab == vocab_out, "table must be (positions, V, V)"
        self.config = SimpleNamespace(
            vocab_size=vocab, hidden_size=positions * vocab, max_position_embeddings=positions
        )
        self.lm_head = torch.nn.Linear(positions * vocab, vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(table.reshape(positions * vocab, vocab).T)
        self.calls = 0
        self.fed: list[int] = []
        self.last_cache = None

    @classmethod
    def bigram(cls, logits: torch.Tensor, positions: int) -> TableLM:
        """Position-independent logits: ``logits`` is (V, V), row t = the logits after token t."""
        return cls(logits[None].expand(positions, -1, -1).clone())

    @classmethod
    def scripted(cls, tokens_at: list[int], vocab_size: int) -> TableLM:
        """A model that puts all its probability on ``tokens_at[i]`` at sequence index i, whatever came before.

        Other tokens get logit −1e4, whose softmax is exactly 0 in fp32, so sampled decoding is as certain as greedy
        decoding and the acceptance test's outcome is known in advance.
        """
        table = torch.full((len(tokens_at), vocab_size, vocab_size), -1e4)
        for index in range(1, len(tokens_at)):  # the logits at position index - 1 predict the token at index
            table[index - 1, :, tokens_at[index]] = 0.0
        return cls(table)

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, past_key_values=None, use_cache: bool = True, logits_to_keep: int = 0):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        length = input_ids.shape[1]
        start = 0 if past_key_values is None else past_key_values.get_seq_length()
        positions = torch.arange(start, start + length)
        if int(positions[-1]) >= self.config.max_position_embeddings:
            raise IndexError(f"position {int(positions[-1])} is outside the table")
        self.calls += 1
        self.fed.append(length)
        hidden = torch.nn.functional.one_hot(positions * self.config.vocab_size + input_ids, self.config.hidden_size)
        if past_key_values is not None and use_cache:
            tokens = input_ids.float()[:, None, :, None]  # keys/values (B, heads=1, T, head_dim=1) hold the token ids
            past_key_values.update(tokens, tokens, 0)
            self.last_cache = past_key_values
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=self.lm_head(hidden.float()), past_key_values=past_key_values)

    def cached_tokens(self) -> list[int]:
        """Token ids held by the last cache this model wrote to, in position order."""
        return self.last_cache.layers[0].keys[0, 0, :, 0].long().tolist()


def save_bundle(folder: str | Path, target, draft, tokenizer, target_path: str | Path, draft_path: str | Path, **kw):
    """Save a SpecDecPP bundle of ``target`` and ``draft`` (saved at the two paths) with a seeded depth-1 head and
    threshold 0.5 (``kw`` goes to ``SpecDecPP``, e.g. ``calibration``); returns the bundle."""
    from accept_head import AcceptanceHead, SpecDecPP
    from accept_head.models.pairs import ModelSpec

    with torch.random.fork_rng():
        torch.manual_seed(0)
        head = AcceptanceHead(draft.config.hidden_size, depth=1)
    bundle = SpecDecPP(
        target,
        draft,
        head,
        threshold=0.5,
        tokenizer=tokenizer,
        target_spec=ModelSpec(path=str(target_path), dtype="float32"),
        draft_spec=ModelSpec(path=str(draft_path), dtype="float32"),
        **kw,
    )
    bundle.save_pretrained(folder)
    return bundle


def draft_vocabulary(vocab_size: int, written: Sequence[int], leave_out: int, seed: int = 0) -> torch.Tensor:
    """Sorted kept ids of a pruned draft vocabulary for tests that decode known text: a seeded random half of the
    vocabulary plus every token of ``written`` (the target's output) but the ``leave_out`` it holds least often
    (ties: the larger id). The draft can then propose most of the target's tokens — candidates get accepted — and
    the target still writes tokens the draft can never propose."""
    counts: dict[int, int] = {}
    for token in written:
        counts[int(token)] = counts.get(int(token), 0) + 1
    left_out = set(sorted(counts, key=lambda t: (counts[t], -t))[:leave_out])
    half = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[: vocab_size // 2].tolist()
    return torch.tensor(sorted((set(half) | set(counts)) - left_out))


def distilled_feature_draft(target, kept_ids: torch.Tensor, texts, steps: int = 150, unroll: int = 3, seed: int = 0):
    """A :class:`~accept_head.models.feature_draft.FeatureDraft` for ``target`` distilled on ``texts`` (token id lists,
    typically the target's own continuations of the prompts a test decodes), so that its candidates are often the
    target's and the accept path of decoding runs.

    Starting from ``FeatureDraft.from_target`` (the target's LM head rows over ``kept_ids`` and its final norm, both
    frozen), ``fc`` and the decoder layer take ``steps`` full-batch Adam steps on the cross-entropy between the
    draft's kept-vocabulary distribution and the target's (renormalised to ``kept_ids``) at every position of every
    text, plus the squared error of the predicted features — at drafting steps 1..``unroll``, where step k reads
    the step-(k−1) predictions as the decoder feeds them. Every part of ``fc`` is trained: the draft reads the
    target's features, not only the token. Seeded and deterministic; about a second per 50 steps on one core.
    """
    from accept_head.models.feature_draft import FeatureDraft
    from accept_head.models.features import lm_head_input

    lengths = [len(text) for text in texts]
    ids = torch.zeros(len(texts), max(lengths), dtype=torch.long)  # right padding: causal positions never see it
    for row, text in enumerate(texts):
        ids[row, : len(text)] = torch.as_tensor(text)
    valid = torch.arange(1, ids.shape[1])[None] < torch.tensor(lengths)[:, None]  # pair t reads position t + 1
    kept_ids = torch.as_tensor(kept_ids)
    with torch.no_grad():
        features = lm_head_input(target, ids).float()  # (N, T, d): f_t, the LM head's input at position t
        wanted_probs = target(input_ids=ids).logits[:, 1:, kept_ids].float().softmax(-1)  # p(x_{t+2}) on kept
    # Pair t = (f_t, x_{t+1}) predicts f_{t+1}, whose next-token distribution is wanted_probs[:, t].
    inputs, tokens, wanted = features[:, :-1], ids[:, 1:], features[:, 1:]
    scale = float(wanted[valid].pow(2).mean())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = FeatureDraft.from_target(target, kept_ids)
        trained = [*draft.fc.parameters(), *draft.decoder.layers.parameters()]
        optimizer = torch.optim.Adam(trained, lr=3e-3)
        for _ in range(steps):
            step_inputs, loss = inputs, torch.zeros(())
            for _ in range(unroll):
                predicted = draft(step_inputs, tokens)
                log_q = draft.kept_logits(predicted).log_softmax(-1)
                loss = loss - (wanted_probs * log_q).sum(-1)[valid].mean()
                loss = loss + (predicted - wanted).pow(2).sum(-1)[valid].mean() / scale / predicted.shape[-1]
                step_inputs = torch.cat([inputs[:, :1], predicted[:, :-1]], dim=1)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return draft.eval()


def tree_bundle(root: Path, cost_model: dict, tree: dict | None = None) -> Path:
    """A saved tiny bundle under ``root`` (fp32 target and draft folders from :func:`make_pair`, a depth-1 head with
    seed 0, threshold 0.6) with ``cost_model`` and tree settings ``tree``; returns its folder."""
    from accept_head import AcceptanceHead, ModelSpec, SpecDecPP, load_model, load_tokenizer

    target_dir, draft_dir = make_pair(root / "models")
    specs = ModelSpec(str(target_dir), dtype="float32"), ModelSpec(str(draft_dir), dtype="float32")
    draft = load_model(specs[1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        head = AcceptanceHead(draft.config.hidden_size, depth=1)
    bundle = SpecDecPP(
        load_model(specs[0]), draft, head, 0.6, tokenizer=load_tokenizer(specs[0]), cost_model=cost_model,
        tree=tree, target_spec=specs[0], draft_spec=specs[1],
    )  # fmt: skip
    bundle.save_pretrained(root / "bundle")
    return root / "bundle"
