"""Stop-string checks (coordinator/delivery.py): a window of the last tokens per check, the
whole text only to confirm and cut."""

from __future__ import annotations

import asyncio
from typing import Sequence

import numpy as np

from dualvllm.coordinator.delivery import Delivery, stop_window
from dualvllm.coordinator.sequence import SamplingParams, SequenceState
from dualvllm.coordinator.stats import Statistics

# Token id i decodes to LETTERS[i]; ids >= 100 are byte pieces: three in a row are one 3-byte
# character (as byte-level tokenizers split it), fewer followed by a letter decode to a
# replacement character (a window that begins inside the character).
LETTERS = "abcdefghijklmnopqrstuvwxyz"
PIECE = 100


class Decoder:
    name = "base"

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    async def detokenize(self, ids: Sequence[int]) -> str:
        self.calls.append(list(ids))
        text, run = [], 0
        for i in ids:
            if i >= PIECE:
                run += 1
                if run == 3:
                    text.append("€")
                    run = 0
                continue
            if run:
                text.append("\ufffd")
                run = 0
            text.append(LETTERS[i])
        return "".join(text)  # an unfinished character at the end is held back


def sequence(stop: str) -> SequenceState:
    return SequenceState(index=0, prompt="p", theta_prompt_ids=[1], t_prompt_ids=[1],
                         params=SamplingParams(1000, stop=stop), rng=np.random.default_rng(0),
                         sink=asyncio.Queue())


async def run_checks(tokens: list[int], stop: str) -> tuple[SequenceState, Decoder, int]:
    """Append `tokens` one at a time, checking after each, as a scheduler does -> the
    sequence, the decoder, and how many tokens it had when it finished."""
    decoder = Decoder()
    delivery = Delivery(decoder, Statistics())  # type: ignore[arg-type]
    seq = sequence(stop)
    for n, token in enumerate(tokens, start=1):
        seq.tokens.append(token)
        await delivery.check_stop_strings([seq])
        if seq.finish_reason is not None:
            return seq, decoder, n
    return seq, decoder, len(tokens)


async def test_each_check_decodes_a_window_and_a_long_text_is_found_at_the_token_that_ends_it():
    stop = "xyz"
    filler = [i % 20 for i in range(500)]  # letters a..t: no x, y or z
    tokens = filler + [23, 24, 25] + [0, 1]
    seq, decoder, n = await run_checks(tokens, stop)

    assert n == 503 and seq.finish_reason == "stop_string"
    assert seq.text == "".join(LETTERS[i] for i in filler)  # cut before the stop string, whole text
    window = stop_window([stop])
    windows, confirm = decoder.calls[:-1], decoder.calls[-1]
    assert max(map(len, windows)) == window < 30  # never the whole text per token
    assert confirm == tokens[:503]  # the hit confirmed (and cut) on the whole text, once


async def test_a_stop_string_split_over_byte_pieces_is_found():
    stop = "a€b"
    tokens = [2] * 50 + [0, PIECE, PIECE + 1, PIECE + 2, 1, 3]
    seq, _, n = await run_checks(tokens, stop)
    assert n == 55 and seq.finish_reason == "stop_string" and seq.text == "c" * 50


async def test_a_window_edge_that_looks_like_a_stop_string_is_not_one():
    """A window that starts inside a byte-split character decodes it to a replacement character:
    a stop string made of that character matches the window, never the whole text."""
    stop = "\ufffd"
    tokens = [PIECE, PIECE + 1, PIECE + 2] + [2] * (stop_window([stop]) + 20)
    seq, decoder, n = await run_checks(tokens, stop)
    assert seq.finish_reason is None and n == len(tokens)
    assert seq.text is None  # nothing cut: the text is decoded whole at delivery
    window = stop_window([stop])
    assert any(call[0] == PIECE + 1 for call in decoder.calls)  # a window began inside the character
    assert any(len(call) > window for call in decoder.calls)  # ... and its match was checked on the whole text


async def test_a_stop_string_made_by_the_last_token_is_cut_at_delivery():
    """Lockstep ends a stream as its last token is decided: that token's check is delivery's."""
    decoder = Decoder()
    delivery = Delivery(decoder, Statistics())  # type: ignore[arg-type]
    seq = sequence("cd")
    seq.tokens[:] = [0, 1, 2, 3]
    seq.finish_reason = "max_tokens"
    delivery.retire(seq)
    await delivery.aclose()
    out = seq.sink.get_nowait()
    assert out.finish_reason == "stop_string" and out.generated_text == "ab"


# -- the pre-filter (coordinator/stop_filter.py): windows whose tokens' own texts rule a stop out

class WordDecoder(Decoder):
    """Ids WORD + i are SentencePiece-like word starts: " " + LETTERS[i] in a text, LETTERS[i]
    alone or at the start of a text (the marker's space is dropped there)."""

    WORD = 50

    async def detokenize(self, ids: Sequence[int]) -> str:
        self.calls.append(list(ids))
        text = "".join(LETTERS[i] if i < self.WORD else " " + LETTERS[i - self.WORD] for i in ids)
        return text[1:] if text.startswith(" ") else text


class CaseDecoder(Decoder):
    """Breaks the filter's premise: a token's text in a text is not its text alone."""

    async def detokenize(self, ids: Sequence[int]) -> str:
        self.calls.append(list(ids))
        return LETTERS[ids[0]] if len(ids) == 1 else "".join(LETTERS[i] for i in ids).upper()


async def checked(decoder: Decoder, tokens: list[int], stop: str | tuple[str, ...]) -> tuple[SequenceState, int]:
    delivery = Delivery(decoder, Statistics())  # type: ignore[arg-type]
    seq = sequence(stop)  # type: ignore[arg-type]
    for n, token in enumerate(tokens, start=1):
        seq.tokens.append(token)
        await delivery.check_stop_strings([seq])
        if seq.finish_reason is not None:
            return seq, n
    return seq, len(tokens)


async def test_after_calibration_only_windows_that_may_hold_a_stop_string_are_decoded():
    from dualvllm.coordinator.stop_filter import CALIBRATION_WINDOWS

    decoder = Decoder()
    filler = [i % 20 for i in range(300)]  # a..t
    seq, n = await checked(decoder, filler + [23, 24, 25, 0], "xyz")
    assert n == 303 and seq.finish_reason == "stop_string" and seq.text == "".join(LETTERS[i] for i in filler)
    singles = [call for call in decoder.calls if len(call) == 1]
    windows = [call for call in decoder.calls if len(call) > 1]
    # each id decoded alone once, and the first window (one token long)
    assert sorted(c[0] for c in singles) == sorted([0, *set(filler + [23, 24, 25])])
    # the calibration windows, then only the one ending in z (x, y alone cannot make "xyz"), and the
    # confirmation on the whole text
    assert len(windows) == CALIBRATION_WINDOWS - 1 + 2  # (the first window is one token long: a single)
    assert windows[-1] == (filler + [23, 24, 25])[:303]


async def test_word_start_spaces_do_not_hide_a_stop_string_and_a_spaces_only_stop_is_always_decoded():
    decoder = WordDecoder()
    word = WordDecoder.WORD
    filler = [word + i % 20 for i in range(100)]  # " a b c ...": no x
    seq, n = await checked(decoder, filler + [word + 23, 1], " xb")
    assert seq.finish_reason == "stop_string" and n == 102
    assert seq.text == "".join(" " + LETTERS[i % 20] for i in range(100))[1:]

    spaces = WordDecoder()
    seq, _ = await checked(spaces, filler, "  ")
    assert seq.finish_reason is None
    assert sum(len(call) > 1 for call in spaces.calls) == len(filler) - 1  # every window decoded


async def test_a_tokenizer_that_breaks_the_premise_turns_the_filter_off_and_stop_strings_are_still_found(caplog):
    decoder = CaseDecoder()
    seq, n = await checked(decoder, [0, 1, 2] * 30 + [23, 24], ("XY",))
    assert seq.finish_reason == "stop_string" and n == 92
    assert "every stop-string check is decoded by the server" in caplog.text
    assert sum(len(call) > 1 for call in decoder.calls) >= 90  # every window decoded after that


async def test_once_calibrated_checks_are_settled_synchronously_where_the_tokens_texts_allow():
    decoder = Decoder()
    stats = Statistics()
    delivery = Delivery(decoder, stats)  # type: ignore[arg-type]
    seq = sequence("xyz")
    assert delivery.unsettled([seq]) == [True]  # nothing known yet: the check must run
    for token in [i % 20 for i in range(40)]:  # a..t: calibrates, every id known
        seq.tokens.append(token)
        await delivery.check_stop_strings([seq])
    calls = len(decoder.calls)
    seq.tokens.append(23)  # "x": known? not yet, so unsettled
    assert delivery.unsettled([seq]) == [True]
    await delivery.check_stop_strings([seq])  # learns "x" alone; "x" cannot make "xyz": not decoded as a window
    assert decoder.calls[calls:] == [[23]]
    seq.tokens.append(0)
    checks = stats.stop_checks
    assert delivery.unsettled([seq]) == [False] and stats.stop_checks == checks + 1  # settled, no request
    assert len(decoder.calls) == calls + 1
    seq.tokens[-1:] = [24, 25]  # "...xyz"
    await delivery.check_stop_strings([seq])  # learns y and z alone, then decodes the window
    assert delivery.unsettled([seq]) == [True] and seq.finish_reason == "stop_string"
