"""The chat's live status: after the streamed text on a terminal, erased before the next chunk, absent elsewhere."""

import io
import re

import torch
from tiny_models import make_tokenizer

from accept_head.specdecpp.chat import LiveStreamer

ANSI = re.compile(r"\x1b7\x1b\[2m.*?\x1b\[0m|\x1b8\x1b\[J")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def stream(out: io.StringIO, rounds: list[list[int]]) -> LiveStreamer:
    tokenizer = make_tokenizer()
    streamer = LiveStreamer(tokenizer, out)
    streamer.put(torch.tensor([[5, 6]]))  # the prompt, which generate streams first
    for tokens in rounds:
        streamer.put(torch.tensor(tokens))
    streamer.end()
    return streamer


def test_live_status_on_a_terminal_is_erased_before_each_chunk() -> None:
    tokenizer = make_tokenizer()
    rounds = [[7, 8, 9], [10], [11, 12]]
    out = FakeTerminal()
    streamer = stream(out, rounds)
    text = out.getvalue()
    assert streamer.tokens == 6 and streamer.rounds == 3
    statuses = re.findall(r"\[([\d.]+) tok/s · ([\d.]+) tok/round\]", text)
    assert [float(per_round) for _, per_round in statuses] == [3.0, 2.0, 2.0]  # running tokens per round
    # Every status is followed by an erase before more text arrives, and none is left at the end.
    assert text.count("\x1b7") == text.count("\x1b8\x1b[J") == 3
    assert ANSI.sub("", text) == tokenizer.decode(sum(rounds, []), skip_special_tokens=True) + "\n"


def test_no_status_off_a_terminal() -> None:
    out = io.StringIO()
    stream(out, [[7, 8], [9]])
    assert "\x1b" not in out.getvalue() and out.getvalue().endswith("\n")
