"""The acceptance head's input: the draft's final hidden state e_i (after the final norm, the LM head's input).

Training needs e_i at every position of a teacher-forced sequence. Running the full causal LM would also compute the
(B, T, V) logits, which for a 49k vocabulary costs more than the rest of a small draft; so the decoder stack
(``get_decoder()``) is run alone and its ``last_hidden_state`` used. That this state is exactly what the LM head
reads is checked once per model by :func:`decoder_matches_lm_head_input`; models where it is not (a norm applied in
the causal-LM wrapper, say) take the slower path that captures the LM head's input with a forward pre-hook.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def capture_lm_head_input(model: torch.nn.Module) -> Iterator[list[torch.Tensor | None]]:
    """Within the ``with`` block a forward pre-hook on ``model``'s output embedding keeps its input (the final, normed
    hidden state): after a forward pass the yielded ``box[0]`` holds the (B, T, d) tensor the LM head read (only the
    positions it was asked for: ``logits_to_keep`` slices before the head). The hook is removed on exit."""
    box: list[torch.Tensor | None] = [None]

    def hook(module, args) -> None:
        box[0] = args[0]

    handle = model.get_output_embeddings().register_forward_pre_hook(hook)
    try:
        yield box
    finally:
        handle.remove()


@torch.no_grad()
def lm_head_input(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """(B, T, H): the input of ``model.get_output_embeddings()`` at every position, captured by a pre-hook."""
    with capture_lm_head_input(model) as box:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=0)
    return box[0]


@torch.no_grad()
def decoder_matches_lm_head_input(model: torch.nn.Module, atol: float = 1e-5) -> bool:
    """Whether ``model.get_decoder()``'s ``last_hidden_state`` equals the LM head's input (checked on 8 tokens)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        return False
    device = next(model.parameters()).device
    ids = torch.arange(8, device=device)[None, :] % model.config.vocab_size
    via_decoder = decoder(input_ids=ids, use_cache=False).last_hidden_state
    via_hook = lm_head_input(model, ids)
    return via_decoder.shape == via_hook.shape and torch.allclose(via_decoder.float(), via_hook.float(), atol=atol)


@torch.no_grad()
def lm_head_gives_logits(model: torch.nn.Module, atol: float = 1e-4) -> bool:
    """Whether ``model``'s logits are its LM head applied to that head's input (checked on 8 tokens): no soft-capping
    or scale after the head, so p = softmax(state · E) holds for the states :func:`final_hidden_states` returns."""
    device = next(model.parameters()).device
    ids = torch.arange(8, device=device)[None, :] % model.config.vocab_size
    with capture_lm_head_input(model) as box:
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=0).logits
    via_head = model.get_output_embeddings()(box[0])
    return logits.shape == via_head.shape and torch.allclose(logits.float(), via_head.float(), atol=atol)


def logits_from_decoder(model: torch.nn.Module) -> bool:
    """Whether ``model``'s logits are its LM head applied to ``get_decoder()``'s ``last_hidden_state``: no norm, scale
    or soft-capping outside the decoder, so a caller may run the decoder alone and keep its states without changing
    what the model samples."""
    return decoder_matches_lm_head_input(model) and lm_head_gives_logits(model)


@torch.no_grad()
def final_hidden_states(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    use_decoder: bool = True,
) -> torch.Tensor:
    """The final (post-norm) hidden state at every position: input_ids (B, T) → (B, T, H).

    The state at position t has consumed input token t (it is what produces the next-token logits there), which is
    the state SpecDec++ scores token t with. ``use_decoder=False`` runs the full model and captures the LM head's
    input instead (use it when :func:`decoder_matches_lm_head_input` is False).
    """
    if use_decoder:
        decoder = model.get_decoder()
        return decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return lm_head_input(model, input_ids, attention_mask)


@torch.inference_mode()
def teacher_force(target: torch.nn.Module, seqs: list[torch.Tensor], batch_tokens: int, use_decoder: bool) -> list:
    """(final hidden states (n, d) bf16, logsumexp of the logits (n,) float32), on the CPU, of every token sequence
    in ``seqs`` (sorted by length: neighbours share a pass of about ``batch_tokens`` padded tokens)."""
    device = next(target.parameters()).device
    lm_head = target.get_output_embeddings()
    out, i = [], 0
    while i < len(seqs):
        j, budget = i + 1, max(batch_tokens, len(seqs[i]))
        while j < len(seqs) and (j - i + 1) * len(seqs[j]) <= budget:
            j += 1
        ids = torch.nn.utils.rnn.pad_sequence(seqs[i:j], batch_first=True, padding_value=0).to(device)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(b) for b in seqs[i:j]], batch_first=True).to(device)
        hidden = final_hidden_states(target, ids, mask, use_decoder=use_decoder)[mask.bool()]  # real positions
        chunk = 1024 if device.type == "cpu" else 8192  # rows of (chunk, V) logits at a time
        lse = torch.cat([lm_head(c).float().logsumexp(-1) for c in hidden.split(chunk)]).cpu()
        lengths = [len(tokens) for tokens in seqs[i:j]]
        out += list(zip(hidden.to(torch.bfloat16).cpu().split(lengths), lse.split(lengths)))
        i = j
    return out
