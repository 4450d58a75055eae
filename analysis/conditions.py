"""``--exclude`` conditions: a small grammar evaluated on a table's columns, never Python.

    condition := term (("or" | "|") term)*
    term      := factor (("and" | "&") factor)*
    factor    := "not" factor | "(" condition ")" | operand [("==" | "!=" | "<" | "<=" | ">" | ">=") operand]
    operand   := COLUMN | NUMBER | 'text' | "text"

A bare operand stands for itself (a column of true/false values). Nothing else is accepted: no calls,
attributes, indexing or arithmetic, so a condition can only compare columns with constants.
"""

from __future__ import annotations

import operator
import re

import numpy as np
import pandas as pd

_TOKEN = re.compile(r"\s*(?:(?P<number>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)|(?P<text>'[^']*'|\"[^\"]*\")"
                    r"|(?P<op>==|!=|<=|>=|<|>|&|\||\(|\))|(?P<name>[A-Za-z_][A-Za-z0-9_]*))")
_COMPARE = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
            ">=": operator.ge}


class ConditionError(ValueError):
    """The text is not a condition of this grammar; the message is one line."""


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text.rstrip()):
        match = _TOKEN.match(text, pos)
        if not match:
            raise ConditionError(f"unexpected {text[pos:].strip()[:20]!r}")
        kind = match.lastgroup
        out.append((kind, match.group(kind)))
        pos = match.end()
    return out


class _Parser:
    def __init__(self, text: str, frame: pd.DataFrame):
        self.tokens, self.at, self.frame = _tokens(text), 0, frame

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self, *values: str) -> bool:
        token = self.peek()
        if token is not None and token[1] in values and token[0] in ("op", "name"):
            self.at += 1
            return True
        return False

    def condition(self) -> np.ndarray:
        value = self.term()
        while self.take("or", "|"):
            value = np.logical_or(value, self.term())
        return value

    def term(self) -> np.ndarray:
        value = self.factor()
        while self.take("and", "&"):
            value = np.logical_and(value, self.factor())
        return value

    def factor(self) -> np.ndarray:
        if self.take("not"):
            return np.logical_not(self.factor())
        if self.take("("):
            value = self.condition()
            if not self.take(")"):
                raise ConditionError("a '(' is not closed")
            return value
        left = self.operand()
        token = self.peek()
        if token is not None and token[1] in _COMPARE:
            self.at += 1
            return _COMPARE[token[1]](left, self.operand())
        return left

    def operand(self) -> object:
        token = self.peek()
        if token is None:
            raise ConditionError("the condition ends too soon")
        self.at += 1
        kind, value = token
        if kind == "number":
            return float(value)
        if kind == "text":
            return value[1:-1]
        if kind == "name" and value not in ("and", "or", "not"):
            if value not in self.frame.columns:
                raise ConditionError(f"no column named {value!r}")
            return self.frame[value].to_numpy()
        raise ConditionError(f"unexpected {value!r}")


def evaluate(text: str, frame: pd.DataFrame) -> np.ndarray:
    """The rows of ``frame`` where the condition ``text`` holds (ConditionError when it is not one)."""
    parser = _Parser(text, frame)
    value = parser.condition()
    if parser.peek() is not None:
        raise ConditionError(f"unexpected {parser.peek()[1]!r}")
    return np.asarray(value)
