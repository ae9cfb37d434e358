"""A tiny DOM built with the standard library's HTMLParser, enough to read the pages' tables.

Text is unescaped by the parser, so assertions on ``text`` see what a reader sees; assertions
on escaping look at the raw response instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


@dataclass
class Node:
    """An element: its tag, attributes, children and text pieces in document order."""

    tag: str
    attrs: dict[str, str] = field(default_factory=dict)
    children: list[Node | str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """All text below this element, whitespace collapsed."""
        parts: list[str] = []
        for child in self.children:
            parts.append(child if isinstance(child, str) else "\0" if child.tag == "wbr" else child.text)
        return " ".join(" ".join(parts).replace(" \0 ", "").split())  # <wbr> is a break point, no text

    def walk(self) -> Iterator[Node]:
        """This element and every element below it."""
        yield self
        for child in self.children:
            if isinstance(child, Node):
                yield from child.walk()

    def all(self, tag: str, **attrs: str) -> list[Node]:
        """Elements below with ``tag`` whose attributes include ``attrs`` (class_ matches one class)."""
        wanted = {k.rstrip("_"): v for k, v in attrs.items()}
        found = []
        for node in self.walk():
            if node.tag != tag:
                continue
            if all(
                (v in node.attrs.get(k, "").split()) if k == "class" else node.attrs.get(k) == v
                for k, v in wanted.items()
            ):
                found.append(node)
        return found

    def one(self, tag: str, **attrs: str) -> Node:
        """The single element matching; AssertionError if there are none or several."""
        found = self.all(tag, **attrs)
        assert len(found) == 1, f"{len(found)} <{tag} {attrs}> elements"
        return found[0]

    def rows(self) -> list[list[str]]:
        """The texts of the cells of each body row of this table."""
        return [[cell.text for cell in row.all("td")] for body in self.all("tbody") for row in body.all("tr")]

    def header(self) -> list[str]:
        """The texts of this table's header cells."""
        return [cell.text for cell in self.one("thead").all("th")]

    def links(self) -> list[tuple[str, str]]:
        """(href, text) of every link below."""
        return [(a.attrs.get("href", ""), a.text) for a in self.all("a")]


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document")
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for depth in range(len(self.stack) - 1, 0, -1):
            if self.stack[depth].tag == tag:
                del self.stack[depth:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


def parse(html: str) -> Node:
    """The document's root node."""
    builder = _Builder()
    builder.feed(html)
    builder.close()
    return builder.root
