"""Templates substitute {name} from the state only; user text is never a template."""

from __future__ import annotations

from ragserve.graph import Passage, Template


def test_substitutes_names_and_escapes() -> None:
    t = Template.parse("Q: {input} {{literal}} {missing}!")
    assert t.variables == {"input", "missing"}
    assert t.render({"input": "why?"}) == "Q: why? {literal} !"


def test_format_tricks_in_template_render_literally() -> None:
    source = "{x.__class__} {0} {} {input!r} {input:>10} {a[0]} {input}"
    out = Template.parse(source).render({"input": "hi", "x": object(), "a": ["no"]})
    assert out == "{x.__class__} {0} {} {input!r} {input:>10} {a[0]} hi"


def test_values_are_not_rescanned() -> None:
    t = Template.parse("Answer: {input}")
    evil = "{input.__class__.__mro__} {secret} {{x}}"
    assert t.render({"input": evil, "secret": "leak"}) == f"Answer: {evil}"


def test_passages_render_numbered() -> None:
    docs = [Passage("a", " Paris is the capital. ", "France"), Passage("b", "Berlin.", None)]
    out = Template.parse("{docs}").render({"docs": docs})
    assert out == "[1] France\nParis is the capital.\n\n[2] Berlin."


def test_passage_text_with_braces_stays_literal() -> None:
    docs = [Passage("a", "{input} {docs}", "T")]
    assert Template.parse("{docs}|{input}").render({"docs": docs, "input": "q"}) == (
        "[1] T\n{input} {docs}|q"
    )


def test_empty_and_none_values() -> None:
    assert Template.parse("[{a}][{b}]").render({"a": None, "b": []}) == "[][]"
