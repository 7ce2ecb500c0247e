"""``ToolCallStream``: a chat stream's text turned into content deltas or tool-call deltas, per choice.

A tool call (``frontend.tools``) is the whole answer, one JSON object, so a choice's text is held back while
it may still be one: while it is blank, always; once it starts with ``{``, until the choice ends (then it is
parsed: tool calls, or, if it is not a call, the held text as content). Text that starts otherwise streams as
content at once. With ``tool_choice`` ``required`` or a named function the answer is always a call, so it is
held to the end. The tool calls go out in one delta per choice (each call whole: ``index``, ``id``, ``type``,
``function`` with its ``name`` and complete ``arguments``), which OpenAI's SDK accumulates like split ones;
the choice's finish reason becomes ``tool_calls``. A call cut short (``max_tokens``) sends the calls completed
before the cut, if any, and its finish reason (``length``), never the held call object as content
(``tools.answer_of``).

Thread: one instance per request, used on the front's event loop only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from frontend.tools import ToolPlan, answer_of


@dataclass
class _Choice:
    held: str = ""
    streaming: bool = False


@dataclass(frozen=True)
class ChoiceDelta:
    """What one choice's chunk carries after the filter: content (None: none), tool calls, finish reason."""

    content: str | None
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str | None = None


@dataclass
class ToolCallStream:
    """Filters every choice of one streamed chat request (``plan``: its tools)."""

    plan: ToolPlan
    _choices: dict[int, _Choice] = field(default_factory=dict)

    def feed(self, index: int, text: str, finish_reason: str | None) -> ChoiceDelta:
        """The delta to send for ``text`` (new text of choice ``index``) and its finish reason (last one)."""
        choice = self._choices.setdefault(index, _Choice())
        if choice.streaming:
            return ChoiceDelta(text or None, None, finish_reason)
        choice.held += text
        stripped = choice.held.lstrip()
        if stripped and not stripped.startswith("{") and not self.plan.constrained:
            choice.streaming = True
            out, choice.held = choice.held, ""
            return ChoiceDelta(out, None, finish_reason)
        if finish_reason is None:
            return ChoiceDelta(None)
        answer = answer_of(choice.held, finish_reason, self.plan)
        calls = None if answer.tool_calls is None else \
            [{"index": i, **call} for i, call in enumerate(answer.tool_calls)]
        return ChoiceDelta(answer.content or None, calls, answer.finish_reason)
