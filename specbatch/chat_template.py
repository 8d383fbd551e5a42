"""How a model's chat template is handed a row's messages, as vLLM hands them (its "auto" content
format and developer role): a template that loops over a message's content (Gemma 3's, Llama 4's,
Mistral Small 3's) gets every content as OpenAI's list of text parts, any other gets one string,
a list's texts joined with newlines; a 'developer' turn is a system turn for a template that
never names the role, the system turns then merged into one first turn. Torch-free.

Messages here are data/fields.py's: each content a string or a list of part texts."""
from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes as nodes


class _Generation(jinja2.ext.Extension):
    """transformers' {% generation %} ... {% endgeneration %} block, parsed as its body."""
    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _name(node: nodes.Node, names: set[str]) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


def _reads(node: nodes.Node, names: set[str], key: str | None = None) -> bool:
    """`node` is one of `names` (or its `key` item: x['content'], x.content, of the name itself),
    under any filter, test or slice."""
    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            break
    if key is None:
        return _name(node, names)
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == key and _name(node.node, names)
    return isinstance(node, nodes.Getattr) and node.attr == key and _name(node.node, names)


def _aliases(tree: nodes.Template, name: str) -> set[str]:
    """`name` and every variable set from it ({% set msgs = messages[1:] %}), transitively."""
    names, grew = {name}, True
    while grew:
        grew = False
        for a in tree.find_all(nodes.Assign):
            if isinstance(a.target, nodes.Name) and a.target.name not in names and _reads(a.node, names):
                names.add(a.target.name)
                grew = True
    return names


def _loop_targets(tree: nodes.Template, over: set[str], key: str | None = None) -> Iterator[str]:
    for loop in tree.find_all(nodes.For):
        if isinstance(loop.target, nodes.Name) and _reads(loop.iter, over, key):
            yield loop.target.name


@functools.lru_cache(maxsize=16)
def content_as_parts(template: str) -> bool:
    """Whether the template loops over a message's content ({% for part in message['content'] %},
    or over a variable named content), so expects it as a list of parts. A template jinja cannot
    parse reads strings."""
    try:
        tree = jinja2.Environment(extensions=[_Generation, jinja2.ext.loopcontrols]).parse(template)
    except Exception:  # noqa: BLE001 - the template's own error is the row's, when it renders
        return False
    message = set(_loop_targets(tree, _aliases(tree, "messages")))
    if message and next(_loop_targets(tree, message, "content"), None) is not None:
        return True
    return next(_loop_targets(tree, {"content"}), None) is not None


def texts(content: str | list[str]) -> list[str]:
    """A message's content (data/fields.py's form) as its texts."""
    return [content] if isinstance(content, str) else content


def _text(content: str | list[str]) -> str:
    return content if isinstance(content, str) else "\n".join(t for t in content if t)     # (vLLM drops empty ones)


def _no_developer(messages: list[dict]) -> list[dict]:
    """Developer turns as system turns; system turns anywhere but first, or several, merged into
    one first turn (their texts joined by blank lines), as vLLM does for such a template."""
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    systems = [i for i, m in enumerate(messages) if m["role"] == "system"]
    if systems in ([], [0]):
        return messages
    merged = "\n\n".join(t for t in (_text(messages[i]["content"]) for i in systems) if t)
    return [{"role": "system", "content": merged}] + [m for m in messages if m["role"] != "system"]


def template_messages(messages: list[dict], template: str) -> list[dict]:
    """`messages` as `template` is handed them."""
    if any(m["role"] == "developer" for m in messages) and \
            '"developer"' not in template and "'developer'" not in template:
        messages = _no_developer(messages)
    if content_as_parts(template):
        return [{**m, "content": [{"type": "text", "text": t} for t in texts(m["content"])]} for m in messages]
    return [m if isinstance(m["content"], str) else {**m, "content": _text(m["content"])} for m in messages]
