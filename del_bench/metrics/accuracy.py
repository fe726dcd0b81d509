"""Answer extraction and accuracy for GSM8K and AQuA-RAT.

Generation is not stopped at the end of the answer by default (the paper stops only at EOS / 512 tokens), so
a model often goes on to write the next few-shot question. Extraction therefore first cuts the output at the
stop string the reference evaluators use — "Question:" for GSM8K (lm-eval's `until`), "Q:" for AQuA (Sirius'
stopping criterion) — which makes the metric the same whether or not generation stopped there.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from del_bench.metrics.text import cut_at

GSM8K_STOPS = ("Question:",)
AQUA_STOPS = ("Q:",)

_HASH_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")  # lm-eval "strict-match" / the GSM8K answer format
_ANY_NUMBER = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")  # lm-eval "flexible-extract" (last match)
_AQUA_TRIGGER = "so the answer is"
# After the trigger: optional ":" and "(", one letter a-e, not followed by another letter ("(c)", "c.", "c").
_AQUA_LETTER = re.compile(r"\s*:?\s*\(?([a-e])(?![a-z])")


def to_number(text: str | None) -> Decimal | None:
    """'1,000', '$18.', '-5' -> Decimal; None when it is not a number. Compared numerically, so 72.00 == 72."""
    if text is None:
        return None
    cleaned = text.replace(",", "").replace("$", "").rstrip(".")
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def gsm8k_reference(answer: str) -> Decimal:
    """The number after '#### ' in a GSM8K reference answer."""
    found = _HASH_ANSWER.search(answer)
    if found is None or to_number(found.group(1)) is None:
        raise ValueError(f"no '#### <number>' in GSM8K answer {answer[-60:]!r}")
    return to_number(found.group(1))


def gsm8k_strict(output: str) -> Decimal | None:
    """The first '#### N' of the output's answer (cut at the next 'Question:'), None when absent."""
    found = _HASH_ANSWER.search(cut_at(output, GSM8K_STOPS))
    return to_number(found.group(1)) if found else None


def gsm8k_flexible(output: str) -> Decimal | None:
    """The last number of the output's answer (cut at the next 'Question:'), None when there is none."""
    for match in reversed(_ANY_NUMBER.findall(cut_at(output, GSM8K_STOPS))):
        number = to_number(match[0] or match[1])
        if number is not None:
            return number
    return None


def aqua_letter(output: str) -> str | None:
    """The option letter ('a'-'e') after the first 'so the answer is' of the answer (cut at 'Q:'), else None.

    Sirius lowercases, finds "so the answer is ", and reads up to the next "."; it takes the text when one
    character long, else its second character ("(c)" -> "c"). This agrees on those forms and also accepts a
    missing final period or a colon ("So the answer is: (b)"), which Sirius scores as wrong.
    """
    text = cut_at(output, AQUA_STOPS).lower()
    at = text.find(_AQUA_TRIGGER)
    if at < 0:
        return None
    found = _AQUA_LETTER.match(text, at + len(_AQUA_TRIGGER))
    return found.group(1) if found else None
