"""Thinking apart from the answer, by token id: the one place quantkit splits a generation into channels.

The chat template and the model mark reasoning with two added tokens, `<think>` and `</think>`. A
`ChannelSplitter` is fed the generated ids one at a time and says, for each, which channel it belongs
to and what printable text it adds there. Everything that shows a generation (chat, generate, the
OpenAI server's `reasoning_content`/`content`) reads these channels; nobody re-parses tags from text,
so a tag-like string the model spells out in ordinary tokens stays text.

Rules (vLLM's `qwen3` reasoning parser, decided by id instead of by string):
- with thinking on, the template ends the prompt inside `<think>`: output is "thinking" until
  `</think>`, then "answer"; with thinking off the template has already closed the block, so output
  starts as "answer". A `<think>` id opens thinking again, `</think>` closes it; a tag for the channel
  already current changes nothing. The tags belong to the thinking channel and add no text.
- the newlines the template puts around the tags are trimmed, as Qwen's template does when it renders
  history: each section's leading newlines, and thinking's trailing newlines (held back until more
  thinking text shows they were inner newlines).
"""

from __future__ import annotations

from typing import Any

THINKING = "thinking"
ANSWER = "answer"


class StreamingDetokenizer:
    """Incremental decode: re-decodes only the tokens since the last clean character boundary."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.printed = ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next byte
        delta = text[len(self.printed):]
        if len(self.ids) > 8:  # start afresh from a clean boundary so decode cost stays constant
            self.ids, self.printed = [], ""
        else:
            self.printed = text
        return delta

    def reset(self) -> None:
        self.ids, self.printed = [], ""


class ChannelSplitter:
    """Generated ids -> (channel, text delta); `texts` holds each channel's text so far."""

    def __init__(self, tokenizer: Any, think_ids: tuple[int | None, int | None], thinking: bool):
        self.detok = StreamingDetokenizer(tokenizer)
        self.open_id, self.close_id = think_ids
        self.channel = THINKING if thinking else ANSWER
        self.texts: dict[str, list[str]] = {THINKING: [], ANSWER: []}
        self._started = False  # the current section has printed text (its leading newlines are behind it)
        self._held = ""  # thinking's trailing newlines, printed only if more thinking text follows

    def feed(self, token: int) -> tuple[str, str]:
        """The channel `token` belongs to and the text it adds there (often "", e.g. for a tag)."""
        if token is not None and token in (self.open_id, self.close_id):
            self._switch(THINKING if token == self.open_id else ANSWER)
            return THINKING, ""
        delta = self._trim(self.detok.add(token))
        if delta:
            self.texts[self.channel].append(delta)
        return self.channel, delta

    def text(self, channel: str) -> str:
        return "".join(self.texts[channel])

    def _switch(self, channel: str) -> None:
        if channel != self.channel:
            self.detok.reset()
            self.channel, self._started, self._held = channel, False, ""

    def _trim(self, delta: str) -> str:
        if not self._started:
            delta = delta.lstrip("\n")
            if not delta:
                return ""
            self._started = True
        if self.channel == ANSWER:
            return delta
        body = delta.rstrip("\n")
        if not body:
            self._held += delta
            return ""
        out, self._held = self._held + body, delta[len(body):]
        return out
