"""Which prompts `Engine.prepare_off_loop` prepares on the Trio thread (api.py `prepares_inline`): short ones
with no tools and no grammar; everything else goes to a worker thread."""

from __future__ import annotations

import pytest

from mlx_trio.api import INLINE_PREPARE_MAX_CHARS, prepares_inline

SHORT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "alpha bravo charlie"}]


@pytest.mark.parametrize(("prompt", "kwargs"), [
    ("hello", {}),
    (SHORT, {}),
    (SHORT, {"tools": None, "constraint": None, "chat_template_kwargs": None}),
    ([{"role": "user", "content": [{"type": "text", "text": "a" * 100}]}], {}),
    ([1, 2, 3], {}),
    ("x" * INLINE_PREPARE_MAX_CHARS, {}),
])
def test_short_plain_prompts_are_prepared_inline(prompt, kwargs) -> None:
    assert prepares_inline(prompt, kwargs)


@pytest.mark.parametrize(("prompt", "kwargs"), [
    ("x" * (INLINE_PREPARE_MAX_CHARS + 1), {}),
    ([{"role": "user", "content": "y" * 600}, {"role": "user", "content": "z" * 600}], {}),
    (SHORT, {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    (SHORT, {"constraint": object()}),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}], {}),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {}),
    ([{"role": "user", "content": 5}], {}),
    (list(range(INLINE_PREPARE_MAX_CHARS + 1)), {}),
    (42, {}),
])
def test_long_or_rich_prompts_go_to_a_worker_thread(prompt, kwargs) -> None:
    assert not prepares_inline(prompt, kwargs)
