"""Chat templates rendered in a sandbox with limits.

A chat template is code: the model's own, or one a client sends (`chat_template`). Jinja's
immutable sandbox keeps it away from Python objects, but not from loops or memory: a template
can ask for range(10**9), nest loops, double a string in a loop, or pass huge widths to
filters. Here every loop iteration and every call counts against an operation budget, values
made by `*`, `+`, `~`, calls and filters are size-checked, and so is the output; breaking a
limit raises ChatTemplateError (a ValueError: the server answers 400).

Rendering follows transformers' apply_chat_template for the messages shoal passes (the
tokenizer's special tokens as variables, raise_exception, strftime_now, tojson, namespace,
the loop controls and the {% generation %} tag, continue_final_message)."""

from __future__ import annotations

import contextvars
import functools
import json
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Loop iterations plus calls per render: a chat of thousands of messages needs a few times
# their number; a template that loops for the sake of it stops here (well under a second).
MAX_OPERATIONS = 100_000
MAX_RANGE = 10_000  # range() in a template
MAX_EXPONENT = 1024  # integer ** in a template
MIN_OUTPUT_CHARS = 1 << 20  # values and output may always be this long
CHARS_PER_TOKEN = 32  # ... or this many characters per token of max_model_len

_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_budget",
                                                                          default=None)


class ChatTemplateError(ValueError):
    """The chat template failed or broke a limit (the client's input: a 400)."""


class _Budget:
    def __init__(self, max_chars: int):
        self.ops = MAX_OPERATIONS
        self.max_chars = max_chars

    def spend(self) -> None:
        self.ops -= 1
        if self.ops < 0:
            raise ChatTemplateError(f"the chat template ran more than {MAX_OPERATIONS} loop "
                                    "iterations and calls")

    def check_size(self, value: Any, what: str) -> Any:
        if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > self.max_chars:
            raise ChatTemplateError(f"the chat template made a {what} of {len(value)} items or "
                                    f"characters (limit {self.max_chars})")
        return value

    def check_int(self, value: Any, what: str) -> None:
        if isinstance(value, int) and abs(value) > self.max_chars:
            raise ChatTemplateError(f"the chat template passed {value} to {what} (limit "
                                    f"{self.max_chars})")


def _current() -> _Budget:
    b = _budget.get()
    if b is None:  # rendered outside render_chat_template: the tightest limits
        b = _Budget(MIN_OUTPUT_CHARS)
        _budget.set(b)
    return b


def _counted(iterable: Iterable[Any]) -> Iterator[Any]:
    b = _current()
    for item in iterable:
        b.spend()
        yield item


class _LimitedCodeGenerator(CodeGenerator):
    """Every `~` result is size-checked."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.checked_concat(")
        super().visit_Concat(node, frame)
        self.write(")")


def _guard_filter(fn: Any) -> Any:
    # The value filtered comes first, after the context a pass_* filter takes.
    skip = 2 if hasattr(fn, "jinja_pass_arg") else 1

    @functools.wraps(fn)  # keeps jinja_pass_arg (context, environment, eval context)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        b = _current()
        b.spend()
        for v in (*args[skip:], *kwargs.values()):
            b.check_int(v, f"the filter {fn.__name__}")
        return b.check_size(fn(*args, **kwargs), f"value of the filter {fn.__name__}")
    return guarded


class _GenerationTag(jinja2.ext.Extension):
    """transformers' {% generation %}...{% endgeneration %}: renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """namespace() without underscore-prefixed attributes (as transformers)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed attributes ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _range(*args: int) -> range:
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise ChatTemplateError(f"the chat template asked for range() of {len(r)} items "
                                f"(limit {MAX_RANGE})")
    return r


class LimitedSandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _LimitedCodeGenerator
    intercepted_binops = frozenset(["*", "**", "+"])

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.filters["tojson"] = _tojson
        self.filters = {name: _guard_filter(f) for name, f in self.filters.items()}
        self.filters["_shoal_counted"] = _counted
        self.globals.update(raise_exception=_raise_exception, namespace=_Namespace,
                            range=_range, dict=dict,
                            strftime_now=lambda fmt: datetime.now().strftime(fmt))
        self.globals.pop("lipsum", None)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        """Every `for` loop iterates through the budget (a recursive loop's calls go through
        `call`, which counts them)."""
        tree = super()._parse(source, name, filename)
        for node in tree.find_all(nodes.For):
            if not node.recursive:
                node.iter = nodes.Filter(node.iter, "_shoal_counted", [], [], None, None,
                                         lineno=node.lineno)
        return tree

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _current()
        b.spend()
        if operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                    and abs(right) > MAX_EXPONENT:
                raise ChatTemplateError(f"the chat template raised a number to the power "
                                        f"{right} (limit {MAX_EXPONENT})")
        elif operator == "*":
            for a, n in ((left, right), (right, left)):
                if isinstance(n, int) and isinstance(a, (str, list, tuple)):
                    if len(a) * n > b.max_chars:
                        raise ChatTemplateError(
                            f"the chat template repeated a value {n} times with * (limit "
                            f"{b.max_chars} items or characters)")
        return b.check_size(super().call_binop(context, operator, left, right),
                            f"value of {operator}")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        b = _current()
        b.spend()
        for v in (*args, *kwargs.values()):
            b.check_int(v, "a call")
        rv = super().call(__context, __obj, *args, **kwargs)
        return b.check_size(rv, "call result")

    def checked_concat(self, value: str) -> str:
        return _current().check_size(value, "string made with ~")


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from None


_ENV = LimitedSandbox()
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render_chat_template(source: str, messages: list[Mapping[str, Any]], *,
                         variables: Mapping[str, Any], add_generation_prompt: bool,
                         continue_final_message: bool, max_model_len: int) -> str:
    """Renders a chat (each message a dict) with the template `source`; `variables` are the
    tokenizer's special tokens and the request's chat_template_kwargs."""
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    final = None
    if continue_final_message:
        final = chat[-1].get("content")
        if not isinstance(final, str):
            raise ChatTemplateError("continue_final_message needs a final message with text")
        chat[-1]["content"] = final + _CONTINUE_TAG
    budget = _Budget(max(MIN_OUTPUT_CHARS, CHARS_PER_TOKEN * max_model_len))
    token = _budget.set(budget)
    try:
        # tools and documents default to None; the request's (in variables) override them
        text = _render(_compile(source), budget, {
            "tools": None, "documents": None, **variables, "messages": chat,
            "add_generation_prompt": add_generation_prompt})
    finally:
        _budget.reset(token)
    if final is not None:
        text = _cut_at_continue_tag(text, final)
    return text


def _render(template: jinja2.Template, budget: _Budget, context: dict[str, Any]) -> str:
    parts: list[str] = []
    size = 0
    try:
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > budget.max_chars:
                raise ChatTemplateError(f"the chat template's output passed {budget.max_chars} "
                                        "characters")
            parts.append(chunk)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {e}") from None
    except RecursionError:
        raise ChatTemplateError("the chat template recursed too deeply") from None
    except Exception as e:  # the template's own mistake (a type error...): the client's input
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
    return "".join(parts)


def _cut_at_continue_tag(text: str, final: str) -> str:
    """continue_final_message: the text ends where the final message does (transformers)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message is set but the chat template does not "
                                "render the final message")
    at = text.rindex(tag)
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()
