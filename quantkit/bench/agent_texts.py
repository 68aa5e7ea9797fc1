"""The texts of `quantkit bench serve --agents` (quantkit/bench/serve_agents.py): what an agent framework sends.

- `system_prompt()`: one fixed system prompt shared by every agent, a coding agent's instructions and its tool
  descriptions in Qwen's tool markup (about 700 words), the same text on every call;
- `task(tag, agent)`: an agent's first user message, `observation(tag, agent, turn)`: the tool result it gets
  after each answer (100 to 200 words); both deterministic in their arguments (seeded by them) and distinct
  per agent and turn, so only the system prompt is shared between agents;
- `render(messages)`: the Qwen chat markup of a conversation plus the open assistant turn, as a chat template
  renders it (`<|im_start|>ROLE\\n...<|im_end|>\\n`; a tool result is a user turn holding `<tool_response>`);
- `Agent`: one rollout's history: `prompt()` for the next turn, `answered(text)` appends the answer and the next
  observation. Each turn's prompt starts with the whole of the previous one (only text is appended), so a
  server's prompt cache can reuse it.
"""

from __future__ import annotations

import json
import random

ROLES = ("system", "user", "assistant", "tool")

_INTRO = ("You are a careful software engineering agent working inside a checked out repository on a developer's "
          "machine. You solve the task the user gives by reading code, running commands and editing files with "
          "the tools below, one step at a time. Before you change anything, look at the code that is there and "
          "say in one or two sentences what you will do and why. Keep every edit small and focused on the task; "
          "do not reformat code you did not change. After an edit, run the tests that cover it and read their "
          "output before you go on. When a command fails, read its error, find the cause in the code, and fix "
          "the cause rather than the symptom. Never run commands that delete files outside the repository, "
          "reach the network without need, or print secrets. When the task is done, answer with a short summary "
          "of what changed, which files, and how you checked it.")

_TOOLS: tuple[tuple[str, str, tuple[tuple[str, str, str], ...]], ...] = (
    ("read_file", "Read a text file of the repository and return its lines with their numbers.",
     (("path", "string", "the file's path relative to the repository root"),
      ("start_line", "integer", "the first line to return, counted from 1"),
      ("end_line", "integer", "the last line to return, included"))),
    ("write_file", "Replace a range of lines of a file with new text, or create the file when it is missing.",
     (("path", "string", "the file's path relative to the repository root"),
      ("start_line", "integer", "the first line replaced"), ("end_line", "integer", "the last line replaced"),
      ("text", "string", "the new lines, without line numbers"))),
    ("list_directory", "List the files and folders under a folder of the repository, with their sizes.",
     (("path", "string", "the folder, relative to the repository root"),
      ("depth", "integer", "how many levels of folders to descend"))),
    ("search_code", "Search the repository for a regular expression and return the matching lines.",
     (("pattern", "string", "a regular expression in Python syntax"),
      ("path", "string", "only files under this folder"), ("max_results", "integer", "the most lines returned"))),
    ("run_command", "Run a shell command in the repository root and return its exit code, output and errors.",
     (("command", "string", "the command line, run by bash"),
      ("timeout_seconds", "integer", "stop the command after this many seconds"))),
    ("run_tests", "Run the test suite or a part of it and return the failures with their tracebacks.",
     (("selection", "string", "a test file, folder or node id; empty for every test"),
      ("keyword", "string", "only tests whose names match this expression"))),
    ("git_diff", "Show the changes of the working tree against a commit, as a unified diff.",
     (("base", "string", "the commit to compare against, by default the current one"),
      ("path", "string", "only changes under this path"))),
    ("git_log", "Show the recent commits that touched a path, newest first, with their messages.",
     (("path", "string", "the file or folder"), ("count", "integer", "how many commits to show"))),
    ("find_references", "Find where a function, class or variable is defined and every place that uses it.",
     (("name", "string", "the name to look up, as written in the code"),
      ("path", "string", "only files under this folder"))),
    ("python_eval", "Evaluate a short Python expression in a fresh interpreter and return its value.",
     (("expression", "string", "the expression to evaluate"),)),
)

_TOOL_CALL = ("For each function call, return a json object with function name and arguments within "
              "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
              "<args-json-object>}\n</tool_call>")

_TASKS = ("the parser rejects a config file whose keys are quoted; make it accept them and add a test",
          "the cache grows without bound when keys are long; bound it by bytes and say so in the docs",
          "a test of the scheduler fails now and then on a loaded machine; find out why and fix the cause",
          "the command line tool prints a traceback for a missing input file; make it one clear line",
          "the report writer leaves half a file behind when it is interrupted; make the write atomic",
          "the retry loop of the client ignores the server's Retry-After header; honour it",
          "two modules each define the same date formatting helper; keep one and import it in the other",
          "the export is slow on large folders; find where the time goes and make the slow part faster")

_WORDS = ("value index buffer request result handler session token cache entry config parser writer reader "
          "scheduler worker queue retry timeout limit offset record field column batch stream header status "
          "error message path folder module function return none true false self args kwargs default check "
          "raise assert update append count total size length start end step state").split()
_FOLDERS = ("core", "io", "server", "client", "cli", "utils", "storage", "export", "tests")


def system_prompt() -> str:
    """The shared system prompt: the instructions, then the tools as Qwen's chat template lists them."""
    specs = [{"type": "function", "function": {
        "name": name, "description": what,
        "parameters": {"type": "object", "properties": {p: {"type": t, "description": d} for p, t, d in params},
                       "required": [params[0][0]]}}} for name, what, params in _TOOLS]
    tools = "\n".join(json.dumps(s) for s in specs)
    return (f"{_INTRO}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
            f"</tools>\n\n{_TOOL_CALL}")


def task(tag: str, agent: int) -> str:
    """Agent `agent`'s first user message in the round `tag`."""
    return (f"[{tag} agent {agent}] In this repository, {_TASKS[agent % len(_TASKS)]}. Start by finding the "
            "code involved.")


def observation(tag: str, agent: int, turn: int) -> str:
    """The tool result agent `agent` gets after its answer of turn `turn` in round `tag`: search hits, 100 to
    200 words, seeded by the three (the same text on every call, another for any other agent or turn)."""
    rng = random.Random(f"{tag}/{agent}/{turn}")
    lines = [f"search_code: {tag} agent {agent} turn {turn}"]
    words = len(lines[0].split())
    while words < 100 or (words < 170 and rng.random() < 0.7):
        folder, name = rng.choice(_FOLDERS), rng.choice(_WORDS)
        snippet = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 10)))
        lines.append(f"src/{folder}/{name}.py:{rng.randint(1, 900)}: {snippet}")
        words += len(lines[-1].split())
    return "\n".join(lines)


def render(messages: list[tuple[str, str]]) -> str:
    """The chat markup of `messages` ((role, text) pairs) with the assistant's turn opened after them."""
    out = []
    for role, text in messages:
        if role not in ROLES:
            raise ValueError(f"role {role!r}: not one of {ROLES}")
        if role == "tool":
            out.append(f"<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n")
        else:
            out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    return "".join(out) + "<|im_start|>assistant\n"


class Agent:
    """One agent's rollout in round `tag`: the shared system prompt, its task, then its answers and tool results."""

    def __init__(self, tag: str, index: int):
        self.tag, self.index, self.turn = tag, index, 0
        self.messages: list[tuple[str, str]] = [("system", system_prompt()), ("user", task(tag, index))]

    def prompt(self) -> str:
        """The text the next turn sends."""
        return render(self.messages)

    def answered(self, text: str) -> None:
        """The answer of this turn (as the server sent it), then the tool's result for it."""
        self.messages += [("assistant", text), ("tool", observation(self.tag, self.index, self.turn))]
        self.turn += 1
