"""Token logprobs in OpenAI's two wire shapes.

Chat completions: `{"content": [{token, logprob, bytes, top_logprobs: [{token,
logprob, bytes}]}], "refusal": null}`. The legacy text completions endpoint:
`{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`,
where `text_offset` is each token's character offset in the completion,
counted over the tokens' own text (so a stream's chunks continue the count).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_trio.logprobs import TokenLogprob


def chat_logprobs(items: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {"token": item.token, "logprob": item.logprob, "bytes": list(item.bytes),
             "top_logprobs": [{"token": top.token, "logprob": top.logprob, "bytes": list(top.bytes)}
                              for top in item.top_logprobs]}
            for item in items
        ],
        "refusal": None,
    }


def text_logprobs(items: Sequence[TokenLogprob], *, text_offset: int = 0) -> dict[str, Any]:
    """`text_offset` is where the first of `items` starts (the text of the tokens before it)."""
    offsets = []
    for item in items:
        offsets.append(text_offset)
        text_offset += len(item.token)
    return {
        "tokens": [item.token for item in items],
        "token_logprobs": [item.logprob for item in items],
        # A dict by token text, as OpenAI's; two ids with the same text keep the likelier.
        "top_logprobs": [{top.token: top.logprob for top in reversed(item.top_logprobs)} for item in items],
        "text_offset": offsets,
    }


def text_length(items: Sequence[TokenLogprob]) -> int:
    """How far `items` advance `text_offset`."""
    return sum(len(item.token) for item in items)
