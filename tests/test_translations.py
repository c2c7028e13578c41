"""The Chinese edition of the chapters and labs (docs/i18n.py, minivllm/i18n.py).

- every chapter and lab has a translation file, and every block of it translates the
  English cell it names (no stale, missing or orphan block; code, math, links, headings
  and numbers kept; the glossary's terms used);
- a deliberately edited English cell makes its block stale, and the test says so;
- ``say``/``Bi`` refuse a Chinese text whose numbers differ from the English; the
  chapters' ``say``/``Bi`` pairs of f-strings have the same replacement fields, so a
  branch that did not run on this CPU cannot publish a number in one language only;
- ``localize`` puts the translations and the said Chinese in place of the English.
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("docs_i18n", ROOT / "docs" / "i18n.py")
i18n = importlib.util.module_from_spec(_spec)
sys.modules["docs_i18n"] = i18n
_spec.loader.exec_module(i18n)

import minivllm.i18n  # noqa: E402
from minivllm.i18n import Bi, check_numbers, claims_table, numbers, say  # noqa: E402

SOURCES = i18n.sources()


def _id(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


# ------------------------------------------------------------------ minivllm.i18n

def test_numbers_are_tokens_not_digits():
    assert numbers("1e-05 and 4.8e-5, bf16, e4m3, 3.0x, 12") == numbers(
        "12, 3.0x, e4m3 bf16 4.8e-5 1e-05")
    assert numbers("0.25") != numbers("0.250")
    assert numbers("2 of 3") == numbers("3 个中有 2 个")


def test_docs_i18n_reads_what_say_writes():
    """docs/i18n.py keeps its own copies (it loads without the engine's package): the
    metadata key of the Chinese text and the numbers' pattern must be say's."""
    assert i18n.ZH_KEY == minivllm.i18n.ZH_KEY
    assert i18n.NUMBER.pattern == minivllm.i18n.NUMBER.pattern


def test_say_refuses_different_numbers(capsys):
    with pytest.raises(ValueError, match="only in English {'3': 1}"):
        say("2 of 3 prompts diverge", "2 个提示词分歧")
    with pytest.raises(ValueError, match="only in Chinese"):
        Bi("no change", "第 1 处改变")
    with pytest.raises(ValueError, match="missing"):
        say("no zh")
    say("2 of 3 prompts diverge", "3 个提示词中有 2 个分歧")
    say(Bi("holds here", "在此成立"))
    assert capsys.readouterr().out == "2 of 3 prompts diverge\nholds here\n"
    check_numbers("fp8 e4m3 at 448", "fp8 e4m3 最大 448")


def test_claims_table_says_both_languages(capsys):
    claims_table([(Bi("fp16 overflows at 65504", "fp16 在 65504 处溢出"),
                   Bi("yes: 65520 -> inf", "是：65520 -> inf")),
                  ("`a | b`", "3")])
    out = capsys.readouterr().out.splitlines()
    assert out == ["| claim | measured here |", "|---|---|",
                   "| fp16 overflows at 65504 | yes: 65520 -> inf |", "| `a | b` | 3 |"]


# ------------------------------------------------------------------ docs/i18n.py

def test_check_pair_finds_what_a_translation_lost():
    en = ("## 3. The fix\n\nSet `kv_cache_dtype=\"auto\"`: KL drops 20-fold, see "
          "https://github.com/vllm-project/vllm/issues/1 and $x^2$.")
    good = ("## 3. 修复\n\n设置 `kv_cache_dtype=\"auto\"`：KL 降低 20 倍，见 "
            "https://github.com/vllm-project/vllm/issues/1 与 $x^2$。")
    assert i18n.check_pair(en, good) == []
    probs = " ".join(i18n.check_pair(en, "### 3. 修复\n\n设置 `kv_cache_dtype`：KL 降低。"))
    for what in ("code spans", "math", "links", "headings", "numbers", ):
        assert what in probs, (what, probs)
    assert "no Chinese" in " ".join(i18n.check_pair("Just words here.", "Just words here."))
    assert i18n.check_pair("```python\nx = 1\n```", "```python\nx = 1\n```") == []
    assert "fenced" in " ".join(i18n.check_pair("```python\nx = 1\n```", "```python\nx = 2\n```"))


def test_glossary_terms():
    terms = i18n.glossary()
    assert len(terms) >= 90
    assert (["prefill"], ["预填充", "prefill"]) in terms
    assert i18n.check_terms("The prefill fills the KV cache.", "prefill 填满 KV cache。") == []
    assert i18n.check_terms("The prefill fills the KV cache.", "预填充填满键值缓存。") == []
    found = i18n.check_terms("The prefill fills the KV cache.", "预先计算填满 KV cache。")
    assert len(found) == 1 and "'prefill'" in found[0]
    assert i18n.check_terms("The prefill fills it.",
                            "预先计算。<!-- glossary-exempt: prefill -->") == []


def _copy_source(tmp_path: Path, src: Path) -> Path:
    """A chapter/lab source and its translation copied under a fake ROOT-relative path."""
    dst = tmp_path / src.name
    shutil.copy(src, dst)
    if i18n.translation_path(src).is_file():
        shutil.copy(i18n.translation_path(src), i18n.translation_path(dst))
    return dst


def test_an_edited_english_cell_makes_its_block_stale(tmp_path):
    """The stale check, on a deliberate edit: one word of one Markdown cell."""
    src = next((s for s in SOURCES if i18n.translation_path(s).is_file()), None)
    if src is None:
        pytest.skip("no translated source yet")
    dst = _copy_source(tmp_path, src)
    before = i18n.status(dst)
    nb = i18n.read_notebook(dst)
    i = max(i18n.markdown_cells(nb))
    text = dst.read_text()
    english = nb.cells[i].source.splitlines()[-1]
    assert text.count("# " + english) == 1, "the cell's last line must be unique in the source"
    dst.write_text(text.replace("# " + english, "# " + english + " (edited)"))
    after = i18n.status(dst)
    assert i not in before.stale and after.stale == [i], (before, after)


def test_localize_swaps_markdown_and_said_text():
    src = ROOT / "course" / "chXX.py"  # a name only: no translation file, so untranslated
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("Some English."),
        nbformat.v4.new_code_cell("...", outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="a 1\n"),
            nbformat.v4.new_output("display_data", data={"text/plain": "2 of 3"},
                                   metadata={i18n.ZH_KEY: "3 个中有 2 个"}),
            nbformat.v4.new_output("stream", name="stdout", text="b 4\n")])])
    zh = i18n.localize(nb, src, "zh")
    assert zh.cells[0].source.startswith(i18n.UNTRANSLATED["zh"])
    assert [o["text"] for o in zh.cells[1].outputs] == ["a 1\n3 个中有 2 个\nb 4\n"]
    en = i18n.localize(nb, src, "en")
    assert en.cells[0].source == "Some English."
    assert [o["text"] for o in en.cells[1].outputs] == ["a 1\n2 of 3\nb 4\n"]
    assert nb.cells[1].outputs[1]["output_type"] == "display_data"  # the input is kept
    with pytest.raises(i18n.TranslationError):
        i18n.localize(nb, src, "zh", strict=True)


# ------------------------------------------------------------------ the say pairs in chapters

def _fields(node: ast.AST) -> tuple[list[str], list[str]]:
    """(replacement fields with string constants blanked, numbers of the literal parts)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [], sorted(numbers(node.value).elements())
    assert isinstance(node, ast.JoinedStr)
    fields, nums = [], []
    for v in node.values:
        if isinstance(v, ast.Constant):
            nums += numbers(v.value).elements()
        else:
            expr = ast.parse(ast.unparse(v.value), mode="eval")
            for n in ast.walk(expr):
                if isinstance(n, ast.Constant) and isinstance(n.value, str):
                    n.value = ""
                elif isinstance(n, ast.Attribute) and n.attr == "zh":
                    n.attr = "en"  # {x.en} in English, {x.zh} in Chinese: the same field
            spec = ast.unparse(v.format_spec) if v.format_spec else ""
            fields.append(ast.unparse(expr) + "!" + str(v.conversion) + spec)
    return sorted(fields), sorted(nums)


def say_pairs(src: Path):
    """(line, en node, zh node) for each ``say(en, zh)`` and ``Bi(en, zh)`` in ``src``
    whose two texts are string literals or f-strings."""
    tree = ast.parse(src.read_text())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("say", "Bi") and len(node.args) == 2
                and all(isinstance(a, (ast.JoinedStr, ast.Constant)) for a in node.args)):
            yield node.lineno, node.args[0], node.args[1]


@pytest.mark.parametrize("src", i18n.chapter_sources(), ids=_id)
def test_say_pairs_have_the_same_fields(src):
    bad = []
    for line, en, zh in say_pairs(src):
        if _fields(en) != _fields(zh):
            bad.append(f"line {line}: English {_fields(en)}, Chinese {_fields(zh)}")
    assert not bad, "say/Bi pairs whose f-strings differ in fields or numbers:\n" + "\n".join(bad)


# ------------------------------------------------------------------ the translations

# Sources whose translation is not complete yet (the edition is being written): this set
# only shrinks, and the test below fails if it names a complete one or misses one.
PENDING: set[str] = set()


@pytest.mark.parametrize("src", SOURCES, ids=_id)
def test_translation_is_current_and_complete(src):
    if _id(src) in PENDING:
        pytest.skip("not translated yet (PENDING)")
    assert i18n.translation_path(src).is_file(), f"{_id(src)}: no {i18n.translation_path(src).name}"
    st = i18n.status(src)
    assert st.ok, (f"{_id(src)}: stale {st.stale} (the English changed since: update the "
                   f"block, then `python docs/i18n.py accept {_id(src)} N`), missing "
                   f"{st.missing}, orphans {st.orphans}\n" + "\n".join(st.problems))


def test_pending_lists_exactly_the_incomplete():
    incomplete = {_id(s) for s in SOURCES if not i18n.status(s).ok}
    assert incomplete == PENDING & {_id(s) for s in SOURCES}, (
        f"complete but still PENDING: {sorted(PENDING - incomplete)}; "
        f"incomplete but not PENDING: {sorted(incomplete - PENDING)}")


def test_cjk_line_breaks_are_joined():
    assert i18n.join_cjk_lines("之后，\n回答质量\n   并且 x\n\n下一段\n- 列表") == \
        "之后，回答质量并且 x\n\n下一段\n- 列表"
    assert i18n.join_cjk_lines("```\n中\n文\n```") == "```\n中\n文\n```"
    assert i18n.join_cjk_lines("English\nwords") == "English\nwords"
