"""The interactive chat loop behind `quantkit chat`.

Commands: /system [TEXT], /think, /nothink, /clear, /save FILE, /load FILE, /stats, /help, /exit.
Tokens stream as they come, thinking (dim) apart from the answer; after each turn a line gives prompt and
generation tok/s and memory per device. Ctrl-C during a reply stops that reply (what was generated is
kept); Ctrl-C at the prompt does not end the session (/exit or Ctrl-D does).

Context policy: before each turn the whole conversation is rendered by the chat template and counted. If
it plus the room kept for the reply (`-n/--max-tokens`, at most half the context) exceeds the context,
the oldest user/assistant exchanges are dropped, oldest first, and the chat says how many; the system
prompt is never dropped. A message that does not fit even alone with the system prompt is refused.

Prompt cache: the runtime keeps snapshots of the conversation state (quantkit.runtime.state_cache), so each
turn prefills only what is new (the last answer, as the template re-renders it, the new message and the
generation prompt); the turn line and /stats show tokens prefilled vs reused. When /system, /clear, /load or
the context policy changes the conversation before the cached part, the next turn prefills afresh and the
chat says why, once; /think and /nothink change only the generation prompt, so reuse goes on.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from quantkit.errors import QuantkitError
from quantkit.fileio import read_text_bounded, write_atomic
from quantkit.outputs import guard_output, json_with_keys
from quantkit.runtime.generate import GenerationResponse, SamplingParams
from quantkit.runtime.state_cache import snapshot_points
from quantkit.sizes import format_size
from quantkit.termtext import plural, printable

# a saved chat session is text the user wrote and the model answered: 16 MB is millions of tokens
SESSION_LIMIT = 16 << 20

CHAT_FILE_VERSION = 1
SAVED_COMMANDS = ("/clear", "/system", "/think", "/nothink", "/load")  # change what --session keeps
HELP = """commands:
  /system [TEXT]   show the system prompt, or set it (/system - clears it)
  /think           thinking on (the default): the model reasons before answering
  /nothink         thinking off
  /clear           forget the conversation (the system prompt stays)
  /save FILE       write the conversation as JSON
  /load FILE       read a conversation saved with /save
  /stats           figures of the last turn, memory per device, context used, prompt cache
  /help            this text
  /exit            leave (Ctrl-D too)
Ctrl-C stops the reply being generated. When the conversation outgrows the context, the oldest
exchanges are dropped first; the system prompt is always kept."""


@dataclass
class ChatSession:
    """The conversation: a system prompt apart, then alternating user/assistant messages."""

    system: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    thinking: bool = True

    def conversation(self) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def to_json(self) -> str:
        return json.dumps({"quantkit_chat": CHAT_FILE_VERSION, **asdict(self)}, indent=1, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str, source: str) -> ChatSession:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise QuantkitError(f"{source}: not valid JSON (line {e.lineno}: {e.msg})") from None
        except RecursionError:
            raise QuantkitError(f"{source}: the JSON nests too deeply; not a conversation saved by /save") from None
        if not isinstance(d, dict) or d.get("quantkit_chat") != CHAT_FILE_VERSION:
            raise QuantkitError(f"{source}: not a conversation saved by quantkit chat (/save)")
        msgs = d.get("messages")
        if not isinstance(msgs, list) or not all(
                isinstance(m, dict) and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)
                for m in msgs):
            raise QuantkitError(f"{source}: 'messages' must be a list of user/assistant messages with text content")
        system = d.get("system")
        if system is not None and not isinstance(system, str):
            raise QuantkitError(f"{source}: 'system' must be text or null")
        return cls(system=system, messages=msgs, thinking=bool(d.get("thinking", True)))


def check_text(text: str, what: str) -> None:
    """Refuse text holding bytes that are not UTF-8 (Python keeps them as lone surrogates, which the tokenizer
    rejects with a TypeError): binary data piped as a prompt is one line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise QuantkitError(f"{what} is not UTF-8 text (bad byte at character {e.start}); pass text") from None


def fit_context(count: Callable[[list[dict[str, Any]]], int], session: ChatSession, context: int,
                reply_room: int) -> tuple[int, int]:
    """Drop the oldest exchanges until the conversation + reply room fits. Returns (messages dropped,
    tokens now). Raises QuantkitError when the last message cannot fit even alone."""
    room = min(reply_room, context // 2)
    dropped = 0
    n = count(session.conversation())
    while n + room > context:
        if len(session.messages) <= 1:
            raise QuantkitError(
                f"this message is {n} tokens with the system prompt; with {room} kept for the reply it does "
                f"not fit the {context}-token context: shorten it or lower -n/--max-tokens")
        # drop the oldest exchange (a user message and the assistant reply after it)
        cut = 2 if len(session.messages) > 2 and session.messages[1]["role"] == "assistant" else 1
        del session.messages[:cut]
        dropped += cut
        n = count(session.conversation())
    return dropped, n


def fmt_bytes(n: float) -> str:
    """Sizes as every command writes them (decimal GB/MB, quantkit.sizes), so serve's banner and /stats agree."""
    return format_size(int(n))


def turn_line(resp: GenerationResponse, weights: dict[str, int]) -> str:
    mem = ", ".join(
        f"{d}: weights {fmt_bytes(weights.get(d, 0))}, peak {fmt_bytes(resp.peak_memory.get(d, 0))}"
        for d in dict.fromkeys([*weights, *resp.peak_memory]))
    return (f"[prompt {resp.prompt_tokens} tok, {resp.prompt_tps:.1f} tok/s | generated {resp.generation_tokens} "
            f"tok, {resp.generation_tps:.1f} tok/s | {resp.finish_reason} | {mem} | prefilled "
            f"{resp.prefilled_tokens}, reused {resp.cached_tokens}"
            + (f" | drafted {resp.mtp['drafted']}, accepted {resp.mtp['accepted']}" if resp.mtp else "") + "]")


def context_line(rt: Any) -> str:
    """`context 32,768 tokens (default: ...)`: the context and where it came from, for a start-up line."""
    why = getattr(getattr(rt, "placement", None), "context_source", "")
    return f"context {rt.context:,} tokens" + (f" ({why})" if why else "")


class Chat:
    """One interactive session over a Runtime. `read` returns the next input line (raises EOFError)."""

    def __init__(self, runtime: Any, session: ChatSession, sampling: SamplingParams, console: Console,
                 read: Callable[[str], str] = input, autosave: Callable[[ChatSession], None] | None = None):
        """`autosave(session)` runs after each turn and command (`--session FILE` writes the file there)."""
        self.rt, self.s, self.sp, self.out, self.read = runtime, session, sampling, console, read
        self.autosave = autosave
        self.last: GenerationResponse | None = None
        self.context_used = 0
        self.totals = {"prefilled": 0, "reused": 0}
        self.changed: str | None = None  # why the conversation's start changed since the last turn
        self.reusable = 0  # prompt tokens the next turn should find cached, if the conversation only grew

    def say(self, text: str, style: str = "cyan") -> None:
        self.out.print(printable(text), style=style, highlight=False, markup=False, soft_wrap=True)

    def run(self) -> None:
        mtp = f"; {self.rt.mtp_line()}" if self.rt.model.mtp is not None else ""
        if self.s.messages and not self.context_used:  # a resumed or loaded conversation: /stats counts it
            self.context_used = self.rt.count_tokens(self.s.conversation(), enable_thinking=self.s.thinking)
        self.say(f"quantkit chat: {self.rt.folder.name}, {context_line(self.rt)}, thinking "
                 f"{'on' if self.s.thinking else 'off'}{mtp}; /help for commands, /exit to leave")
        while True:
            try:
                line = self.read("you> ")
            except EOFError:
                self.say("")
                break
            except KeyboardInterrupt:
                self.say("\n(Ctrl-C: use /exit or Ctrl-D to leave)")
                continue
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if self.command(line) == "exit":
                    break
                if line.split()[0].lower() not in SAVED_COMMANDS:
                    continue
            else:
                try:
                    check_text(line, "this message")
                except QuantkitError as e:
                    self.say(str(e), "red")
                    continue
                self.turn(line)
            self._autosave()

    def _autosave(self) -> None:
        if self.autosave is None:
            return
        try:
            self.autosave(self.s)
        except QuantkitError as e:
            self.say(str(e), "red")

    # ---- commands ----
    def command(self, line: str) -> str | None:
        cmd, _, arg = line.partition(" ")
        arg = arg.strip()
        cmd = cmd.lower()
        if cmd in ("/exit", "/quit"):
            return "exit"
        if cmd == "/help":
            self.say(HELP, "")
        elif cmd == "/clear":
            self.s.messages.clear()
            self.context_used = 0
            self.changed = "/clear"
            self.say("conversation cleared" + (" (system prompt kept)" if self.s.system else ""))
        elif cmd == "/system":
            if not arg:
                self.say(f"system prompt: {self.s.system!r}" if self.s.system else "no system prompt")
            else:
                self.s.system = None if arg == "-" else arg
                self.changed = "/system"
                self.say("system prompt cleared" if arg == "-" else "system prompt set")
        elif cmd == "/think":
            self.s.thinking = True
            self.changed = "/think"
            self.say("thinking on")
        elif cmd == "/nothink":
            self.s.thinking = False
            self.changed = "/nothink"
            self.say("thinking off")
        elif cmd == "/save":
            self._save(arg)
        elif cmd == "/load":
            self._load(arg)
        elif cmd == "/stats":
            self._stats()
        else:
            self.say(f"unknown command {cmd}; /help lists them", "red")
        return None

    def _save(self, arg: str) -> None:
        if not arg:
            self.say("usage: /save FILE", "red")
            return

        path = Path(arg).expanduser()
        try:  # the one output guard: never over a file quantkit chat did not write, a folder or a FIFO
            guard_output(path, overwrite=True, owned=json_with_keys("quantkit_chat", limit=SESSION_LIMIT),
                         flag="/save ")
            write_atomic(path, self.s.to_json() + "\n")
        except QuantkitError as e:
            self.say(str(e), "red")
            return
        self.say(f"saved {plural(len(self.s.messages), 'message')} to {arg}")

    def _load(self, arg: str) -> None:
        if not arg:
            self.say("usage: /load FILE", "red")
            return
        p = Path(arg).expanduser()
        try:
            self.s = ChatSession.from_json(read_text_bounded(p, "chat session", SESSION_LIMIT), str(p))
        except QuantkitError as e:
            self.say(str(e), "red")
            return
        self.changed = "/load"
        self.context_used = self.rt.count_tokens(self.s.conversation(), enable_thinking=self.s.thinking)
        self.say(f"loaded {plural(len(self.s.messages), 'message')} from {arg}")

    def _stats(self) -> None:
        w = self.rt.memory()
        self.say(f"model {self.rt.folder} ({getattr(self.rt.recipe, 'name', '?')}), placement: "
                 f"{self.rt.placement.source}")
        self.say("weights: " + ", ".join(f"{d} {fmt_bytes(b)}" for d, b in w.items()))
        self.say(self.rt.route_line())
        self.say(self.rt.mtp_line())
        self.say(f"context: {self.context_used:,}/{self.rt.context:,} tokens used, {plural(len(self.s.messages), 'message')}, "
                 f"thinking {'on' if self.s.thinking else 'off'}")
        if self.last:
            self.say("last turn: " + turn_line(self.last, w))
        c = self.rt.prompt_cache.summary()
        if not c["enabled"]:
            self.say("prompt cache: off (every turn prefills the whole conversation)")
            return
        self.say(f"prompt cache: {plural(c['entries'], 'snapshot')}, {fmt_bytes(c['bytes'])} of {fmt_bytes(c['max_bytes'])}, "
                 f"hit rate {c['hit_rate']:.0%}, {c['evictions']} evicted; this session prefilled "
                 f"{self.totals['prefilled']} tokens, reused {self.totals['reused']}")
        d = c.get("disk")
        if d:
            self.say(f"prompt cache on disk: {d['dir']}: {plural(d['entries'], 'entry', 'entries')}, {fmt_bytes(d['bytes'])} of "
                     f"{fmt_bytes(d['max_bytes'])}, {d['hits']} restored ({d['restored_tokens']} tokens)")

    # ---- a turn ----
    def turn(self, text: str) -> None:
        self.s.messages.append({"role": "user", "content": text})

        def count(msgs: list[dict[str, Any]]) -> int:
            return self.rt.count_tokens(msgs, enable_thinking=self.s.thinking)

        try:
            dropped, self.context_used = fit_context(count, self.s, self.rt.context, self.sp.max_new_tokens)
        except QuantkitError as e:
            self.s.messages.pop()
            self.say(str(e), "red")
            return
        if dropped:
            self.say(f"(context full: dropped the {dropped} oldest messages; the system prompt is kept)", "yellow")
            self.changed = "the context overflow"
        prev = signal.signal(signal.SIGINT, lambda *_: self.rt.stop())
        channel, parts = None, {"thinking": [], "answer": []}
        resp = None
        try:
            for ev in self.rt.generate_stream(self.s.conversation(), enable_thinking=self.s.thinking,
                                              sampling=self.sp):
                if ev.response is not None:
                    resp = ev.response
                    break
                if ev.channel != channel and ev.text:
                    if channel is not None:
                        self.out.print()
                    self.say("thinking:" if ev.channel == "thinking" else "answer:", "bold dim"
                             if ev.channel == "thinking" else "bold")
                    channel = ev.channel
                if ev.text:
                    parts[ev.channel].append(ev.text)
                    self.out.print(printable(ev.text), end="", style="dim" if ev.channel == "thinking" else "",
                                   highlight=False, markup=False, soft_wrap=True)
        finally:
            signal.signal(signal.SIGINT, prev)
        self.out.print()
        if resp is None:
            return
        self.last = resp
        self._account(resp)
        msg: dict[str, Any] = {"role": "assistant", "content": resp.text}
        if resp.thinking:
            msg["reasoning_content"] = resp.thinking
        self.s.messages.append(msg)
        if resp.finish_reason == "cancelled":
            self.say("(stopped; the partial reply is kept in the conversation)", "yellow")
        elif resp.finish_reason == "context":
            self.say("(the context is full: the reply was cut; /clear or start afresh)", "yellow")
        self.context_used += resp.generation_tokens
        self.say(turn_line(resp, self.rt.memory()), "dim")

    def _account(self, resp: GenerationResponse) -> None:
        """Count prefilled vs reused tokens; say once when a change of the conversation's start (a command or
        the context policy) made the cache start afresh."""
        self.totals["prefilled"] += resp.prefilled_tokens
        self.totals["reused"] += resp.cached_tokens
        if self.rt.prompt_cache.enabled and self.reusable and resp.cached_tokens < self.reusable:
            why = (f"{self.changed} changed the conversation before the cached part" if self.changed
                   else "its snapshot was evicted (raise --prompt-cache-size)")
            self.say(f"(cache rebuilt: {why}; {resp.prefilled_tokens} tokens prefilled)", "yellow")
        self.changed = None
        points = snapshot_points(self.rt.last_prompt_ids, 0, self.rt.boundary_ids, 1)
        self.reusable = points[0] if points else 0
