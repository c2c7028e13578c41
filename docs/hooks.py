"""mkdocs hooks for the course site (``hooks:`` in mkdocs.yml). What exists on disk drives
the site, so nothing here is kept in step by hand:

- ``on_config``: the nav lists every chapter notebook (``course/chNN_*/chNN_*.py``) and
  every lab (``labs/source/chNN/``) found;
- ``on_files``: a chapter page is the executed copy of its notebook (``notebooks.py``:
  executed once, cached in ``build/notebooks``), rendered by mkdocs-jupyter; a lab page is
  generated from the lab's jupytext source (its text and points, never its solutions)
  and from its grading fixtures;
- ``on_page_markdown``: ``<!-- syllabus -->`` becomes the 30-chapter table with each
  chapter's status, ``<!-- labs -->`` the list of labs, ``<!-- module-map -->`` the
  module map section of README.md, ``<!-- claims -->`` every chapter's
  claim-vs-measurement rows read from its executed notebook (``claims.py``); on a page
  of the Chinese edition (``docs/zh/``) the generated headings and titles are Chinese;
- ``on_post_build``: the Chinese edition gets the site's ``sitemap.xml`` (the language
  selector fetches it);
- ``on_post_page``: a page of the Chinese edition is marked ``<html lang="zh">`` (the
  browser then picks CJK fonts for Chinese, not Japanese glyph variants);
- ``on_page_content``: Sphinx role names left in the API reference are dropped, and the
  CDN MathJax 2 that nbconvert writes into each chapter page is taken out;
- the math renderer is served with the site (no CDN: pages render math offline):
  MathJax 3 from the ``django-static-mathjax`` wheel (docs extra; plain static files,
  no Django needed) goes to ``javascripts/mathjax/`` (``mathjax_files``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import logging
import re
import shutil
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent))
import claims  # noqa: E402  (docs/claims.py)
import i18n  # noqa: E402  (docs/i18n.py)
import notebooks  # noqa: E402  (docs/notebooks.py)

ROOT = notebooks.ROOT
log = logging.getLogger("mkdocs.hooks.minivllm")

# The syllabus (the project's design card): six stages, thirty chapters. Status comes from the disk.
SYLLABUS = [
    ("Stage 1, foundations", [
        "Course introduction and the FP32 baseline; the multi-turn \"FP16 KV cache\" incident",
        "Anatomy of the engine: prefill, decode, KV cache, scheduler; the eviction-and-recompute "
        "incident under memory pressure (max_num_seqs, cache size, prefix caching)",
        "Number formats: fp32, tf32, fp16, bf16, fp8 e4m3/e5m2, int8, int4: range, spacing, "
        "rounding, subnormals",
        "Measuring drift: token agreement, first divergence, KL divergence, top-k overlap, "
        "perplexity ratio, task accuracy; telling noise from an anomaly",
        "Determinism: seeds, sampling, and batch composition at temperature 0",
    ]),
    ("Stage 2, principles", [
        "Prefill versus decode numerics; fixed-prompt and long-output tests",
        "PagedAttention: block tables and slot mapping; what a wrong mapping does",
        "Continuous batching and preemption: resumed requests, state that must survive",
        "Softmax and attention numerics: max subtraction, online softmax, fp16 QK overflow, "
        "fully masked rows",
        "Normalization and the residual stream: RMSNorm accumulation, fp16 activation overflow",
        "RoPE precision and scaling: low-precision cos/sin at long positions, wrong theta",
    ]),
    ("Stage 3, techniques", [
        "Choosing dtype: auto, half, bfloat16, float32; fp32 checkpoints served in fp16",
        "TF32 matmuls: emulated on CPU, real on GPU",
        "INT8 weight-only quantization: per-tensor versus per-channel, outlier channels",
        "INT4 group quantization: round-to-nearest versus AWQ",
        "GPTQ",
        "FP8 weights and activations: static versus dynamic scales, calibration",
        "FP8 KV cache: e4m3 versus e5m2, missing scales, long-context retrieval",
        "KV-cache outliers: per-head scales, INT8 KV",
        "Sampling parameters: temperature, top-k/top-p/min-p and their order, penalties, seeds",
        "Speculative decoding: rejection sampling, greedy equality, verification numerics",
    ]),
    ("Stage 4, practice", [
        "Prefix caching: hit versus miss numerics; what the cache key must include",
        "Chunked prefill: chunk-size dependence; attending to earlier chunks",
        "CUDA graphs and padded batches (eager versus graph)",
        "Tensor parallelism: reduction order, shard layout (torch.distributed, gloo on CPU)",
        "Chat templates, BOS tokens, truncation and max_model_len",
        "The debugging playbook: minimal repro, config bisection, layer-by-layer diff",
    ]),
    ("Stage 5, system", [
        "Performance against precision under a latency SLA: weights, KV cache, batch size",
        "Precision regression tests and production monitoring",
    ]),
    ("Stage 6, frontier", [
        "Batch-invariant kernels and deterministic inference; FP4 formats (MXFP4, NVFP4)",
    ]),
]
# The same, for the Chinese edition (docs/zh/): stage names and chapter titles.
SYLLABUS_ZH = [
    "第一阶段：基础", "第二阶段：原理", "第三阶段：技术", "第四阶段：实践", "第五阶段：系统",
    "第六阶段：前沿",
]
TITLES_ZH = [
    "课程导论与 FP32 基线；多轮对话中的“FP16 KV cache”事故",
    "引擎剖析：prefill、decode、KV cache、调度器；内存压力下的驱逐与重计算事故"
    "（max_num_seqs、缓存大小、前缀缓存）",
    "数值格式：fp32、tf32、fp16、bf16、fp8 e4m3/e5m2、int8、int4：范围、间距、舍入、次正规数",
    "度量漂移：token 一致率、首次分歧位置、KL 散度、top-k 重合度、困惑度比、任务准确率；"
    "区分噪声与异常",
    "确定性：随机种子、采样，以及 temperature 0 下批次组成的影响",
    "prefill 与 decode 的数值差异；固定提示词测试与长输出测试",
    "PagedAttention：块表与槽位映射；映射出错会怎样",
    "连续批处理与抢占：恢复执行的请求，以及必须保留的状态",
    "Softmax 与注意力数值：减去最大值、在线 softmax、fp16 QK 溢出、整行被掩码",
    "归一化与残差流：RMSNorm 的累加、fp16 激活值溢出",
    "RoPE 的精度与缩放：长位置上的低精度 cos/sin、错误的 theta",
    "选择 dtype：auto、half、bfloat16、float32；以 fp16 部署的 fp32 检查点",
    "TF32 矩阵乘法：在 CPU 上模拟，在 GPU 上实测",
    "INT8 仅权重量化：逐张量与逐通道，离群通道",
    "INT4 分组量化：就近取整（RTN）与 AWQ",
    "GPTQ",
    "FP8 权重与激活：静态与动态缩放因子，校准",
    "FP8 KV cache：e4m3 与 e5m2，缺失的缩放因子，长上下文检索",
    "KV cache 离群值：逐头缩放因子，INT8 KV",
    "采样参数：temperature、top-k/top-p/min-p 及其顺序、惩罚项、随机种子",
    "推测解码：拒绝采样、贪心输出一致性、验证阶段的数值",
    "前缀缓存：命中与未命中的数值差异；缓存键必须包含什么",
    "分块预填充：对分块大小的依赖；对前面各块的注意力",
    "CUDA 图与填充后的批次（eager 与 graph 对比）",
    "张量并行：归约顺序、分片布局（torch.distributed，CPU 上用 gloo）",
    "对话模板、BOS token、截断与 max_model_len",
    "调试手册：最小复现、配置二分查找、逐层对比",
    "延迟 SLA 约束下的性能与精度：权重、KV cache、批大小",
    "精度回归测试与生产环境监控",
    "批次不变内核与确定性推理；FP4 格式（MXFP4、NVFP4）",
]
STATUS_AVAILABLE = "available"        # chapter notebook and lab
STATUS_CHAPTER_ONLY = "chapter only"  # notebook, no lab yet
STATUS_PLANNED = "planned"


# ------------------------------------------------------------------ what is on disk

def _number(name: str) -> int:
    m = re.match(r"ch(\d+)", name)
    return int(m.group(1)) if m else -1


def chapters_on_disk() -> dict[int, Path]:
    return {_number(p.parent.name): p for p in notebooks.chapter_sources()}


def labs_on_disk() -> dict[int, Path]:
    """chNN -> the lab's jupytext source (labs/source/chNN/*.py)."""
    out = {}
    for d in sorted((ROOT / "labs" / "source").glob("ch*")):
        srcs = sorted(d.glob("*.py"))
        if d.is_dir() and srcs:
            out[_number(d.name)] = srcs[0]
    return out


def chapter_uri(src: Path, lang: str = "en") -> str:
    return ("zh/" if lang == "zh" else "") + f"chapters/{src.stem}.ipynb"


def lab_uri(n: int, lang: str = "en") -> str:
    return ("zh/" if lang == "zh" else "") + f"labs/ch{n:02d}.md"


# The chapter pages are the executed notebooks (docs/notebooks.py) as each language shows
# them (docs/i18n.py localize: Markdown translated, what the code said in that language).
PAGES_DIR = ROOT / "build" / "site-notebooks"


def localized_path(src: Path, lang: str) -> Path:
    return PAGES_DIR / lang / f"{Path(src).stem}.ipynb"


def write_localized(src: Path, executed: Path) -> dict[str, Path]:
    """The executed notebook of ``src`` as each language's page shows it: lang -> path."""
    import nbformat

    nb = nbformat.read(str(executed), as_version=4)
    out = {}
    for lang in i18n.LANGS:
        out[lang] = localized_path(src, lang)
        out[lang].parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(i18n.localize(nb, src, lang), out[lang])
    return out


def syllabus_rows() -> list[tuple[str, int, str, str]]:
    """(stage, number, title, status) for the 30 chapters."""
    chapters, labs = chapters_on_disk(), labs_on_disk()
    rows, n = [], 0
    for stage, titles in SYLLABUS:
        for title in titles:
            n += 1
            status = (STATUS_PLANNED if n not in chapters else
                      STATUS_AVAILABLE if n in labs else STATUS_CHAPTER_ONLY)
            rows.append((stage, n, title, status))
    return rows


# ------------------------------------------------------------------ mkdocs events

def _chinese_heading_ids() -> None:
    """mkdocs-jupyter makes a heading's id, and its table of contents, with an ASCII slug:
    a Chinese heading would get "7" or an empty id (and no working link). Both use
    ``claims.heading_anchor`` instead, which is the ASCII slug for a heading without
    Chinese characters (the English pages' ids are unchanged)."""
    import functools

    import mkdocs_jupyter.convert as mj_convert
    import mkdocs_jupyter.plugin as mj_plugin
    from markdown.extensions.toc import TocExtension

    mj_convert.slugify = claims.heading_anchor
    mj_plugin.TocExtension = functools.partial(
        TocExtension, slugify=lambda value, separator: claims.heading_anchor(value))


def on_config(config):
    """Fill the nav's "Chapters" and "Labs" sections with what exists."""
    _chinese_heading_ids()
    chapters, labs = chapters_on_disk(), labs_on_disk()
    for entry in config["nav"]:
        if not isinstance(entry, dict):
            continue
        (title, children), = entry.items()
        if title == "Chapters":
            # no nav title: mkdocs-jupyter titles the page with the notebook's heading
            children.extend(chapter_uri(src) for _, src in sorted(chapters.items()))
        elif title == "Labs":
            children.extend({f"Lab {n}": lab_uri(n)} for n in sorted(labs))
        elif title.startswith("中文"):
            children.append({"章节": [chapter_uri(src, "zh") for _, src in sorted(chapters.items())]})
            children.append({"实验": [{f"实验 {n}": lab_uri(n, "zh")} for n in sorted(labs)]})
    return config


def _chapter_title(n: int, lang: str = "en") -> str:
    if lang == "zh":
        return re.split(r"[；：]", TITLES_ZH[n - 1])[0]
    titles = [t for _, ts in SYLLABUS for t in ts]
    short = titles[n - 1].split(";")[0].split(":")[0]
    return short


def page_lang(page) -> str:
    """"zh" for a page of the Chinese edition (docs/zh/), else "en"."""
    return "zh" if page.file.src_uri.startswith("zh/") else "en"


@event_priority(100)  # before mkdocs-jupyter wraps .ipynb files
def on_files(files, config):
    for n, src in sorted(chapters_on_disk().items()):
        try:
            executed = notebooks.executed_notebook(src, log=log.info)
        except Exception as e:  # a chapter that does not run must not publish
            raise PluginError(f"chapter {n}: {e}") from e
        for lang, page in write_localized(src, executed).items():
            files.append(File.generated(config, chapter_uri(src, lang), abs_src_path=str(page)))
    for n, src in sorted(labs_on_disk().items()):
        for lang in i18n.LANGS:
            files.append(File.generated(config, lab_uri(n, lang), content=lab_page(n, src, lang)))
    for uri, path in mathjax_files():
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


@event_priority(100)  # before mkdocs-jupyter renders the page
def on_pre_page(page, config, files):
    """mkdocs-jupyter's wrapper around a generated file loses its ``abs_src_path`` (it
    recomputes it from ``src_dir``, which a generated file does not have): restore it."""
    for src in chapters_on_disk().values():
        for lang in i18n.LANGS:
            if page.file.src_uri == chapter_uri(src, lang):
                page.file.__dict__["abs_src_path"] = str(localized_path(src, lang))
    return page


def on_page_markdown(markdown, page, config, files):
    if "<!-- syllabus -->" in markdown:
        markdown = markdown.replace("<!-- syllabus -->", syllabus_markdown(page))
    if "<!-- labs -->" in markdown:
        markdown = markdown.replace("<!-- labs -->", labs_markdown(page))
    if "<!-- module-map -->" in markdown:
        markdown = markdown.replace("<!-- module-map -->", module_map_markdown())
    if "<!-- claims -->" in markdown:
        markdown = markdown.replace("<!-- claims -->", claims_markdown(page))
    if page_lang(page) == "zh":  # a line break between Chinese characters is no space
        markdown = i18n.join_cjk_lines(markdown)
    return markdown


def on_post_build(config):
    """mkdocs-material's language selector fetches ``sitemap.xml`` under each language's
    link (to keep the reader on the same page when switching): the Chinese edition gets a
    copy of the site's, or every page load asks for a file that is not there."""
    site = Path(config["site_dir"])
    for name in ("sitemap.xml", "sitemap.xml.gz"):
        if (site / name).is_file() and (site / "zh").is_dir():
            shutil.copyfile(site / name, site / "zh" / name)


def on_post_page(output, page, config):
    """The Chinese edition's pages say so: ``<html lang="zh">`` (theme.language is en)."""
    if page_lang(page) == "zh":
        output = re.sub(r'<html lang="[^"]*"', '<html lang="zh"', output, count=1)
    return output


# nbconvert's page template loads MathJax 2 from a CDN (mkdocs-jupyter leaves its URL
# empty: `<script src="">`) and configures it; the site's own MathJax 3 typesets notebook
# Markdown (docs/javascripts/mathjax.js), so the block goes.
NBCONVERT_MATHJAX = re.compile(r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->\s*",
                               re.S)
ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|obj|exc):(?=<code>|<a [^>]*><code>)")


def on_page_content(html, page, config, files):
    """The engine's docstrings cite code with Sphinx roles (:class:`X`); mkdocstrings
    renders `X` as code and leaves the role's name in front of it: drop the name. A
    chapter page loses nbconvert's MathJax 2 loader (see ``NBCONVERT_MATHJAX``)."""
    if page.file.src_uri.startswith("api/"):
        html = ROLE.sub("", html)
    if page.file.src_uri.endswith(".ipynb"):
        html = NBCONVERT_MATHJAX.sub("", html)
    return html


# ------------------------------------------------------------------ the math renderer

MATHJAX_DIST = "django-static-mathjax"  # MathJax 3's npm package, as static files in a wheel
MATHJAX_URI = "javascripts/mathjax"     # where it goes in the site (extra_javascript in mkdocs.yml)
# What of MathJax's es5/ the pages use: the combined component mkdocs.yml loads and what
# it loads on demand (TeX and MathML extensions, the CHTML fonts, the menu's parts and its
# accessibility tools); the other combined components and the SVG output stay out (half).
MATHJAX_KEEP = re.compile(r"^(?:tex-mml-chtml\.js$|input/(?:tex|mml)/|output/chtml/|ui/|a11y/|sre/)")


def mathjax_files() -> list[tuple[str, Path]]:
    """(site uri, file) for the MathJax the site serves itself."""
    try:
        dist = importlib.metadata.distribution(MATHJAX_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise PluginError(f"{MATHJAX_DIST} is not installed (the docs extra: "
                          "pip install -e '.[docs]'); the site serves MathJax itself") from None
    root = Path(dist.locate_file("mathjax/static/mathjax"))
    es5 = root / "es5"
    if not (es5 / "tex-mml-chtml.js").is_file():
        raise PluginError(f"{MATHJAX_DIST} {dist.version}: no es5/tex-mml-chtml.js under {root}")
    out = [(f"{MATHJAX_URI}/LICENSE", root / "LICENSE")] if (root / "LICENSE").is_file() else []
    for p in sorted(es5.rglob("*")):
        rel = p.relative_to(es5).as_posix()
        if p.is_file() and MATHJAX_KEEP.match(rel):
            out.append((f"{MATHJAX_URI}/{rel}", p))
    return out


# ------------------------------------------------------------------ generated markdown

def _rel(page, uri: str) -> str:
    """A link from ``page`` to the docs file ``uri`` (both relative to docs/)."""
    depth = page.file.src_uri.count("/")
    return "../" * depth + uri


# The Chinese edition's words for the generated parts.
STATUS_ZH = {STATUS_AVAILABLE: "可用", STATUS_CHAPTER_ONLY: "仅有章节", STATUS_PLANNED: "计划中"}


def syllabus_markdown(page) -> str:
    zh = page_lang(page) == "zh"
    chapters, labs = chapters_on_disk(), labs_on_disk()
    stages_zh = dict(zip((st for st, _ in SYLLABUS), SYLLABUS_ZH))
    out, stage_now = [], None
    for stage, n, title, status in syllabus_rows():
        if stage != stage_now:
            out += ["", f"## {stages_zh[stage] if zh else stage}", "",
                    "| # | 章节 | 实验 | 状态 |" if zh else "| # | chapter | lab | status |",
                    "|---|---|---|---|"]
            stage_now = stage
        title = TITLES_ZH[n - 1] if zh else title
        lang = "zh" if zh else "en"
        name = (f"[{title}]({_rel(page, chapter_uri(chapters[n], lang))})" if n in chapters
                else title)
        lab = (f"[{'实验' if zh else 'lab'} {n}]({_rel(page, lab_uri(n, lang))})"
               if n in labs else "")
        out.append(f"| {n} | {name} | {lab} | {STATUS_ZH[status] if zh else status} |")
    counts = {s: sum(1 for *_, st in syllabus_rows() if st == s)
              for s in (STATUS_AVAILABLE, STATUS_CHAPTER_ONLY, STATUS_PLANNED)}
    if zh:
        head = (f"{counts[STATUS_AVAILABLE]} 章连同实验已可用，{counts[STATUS_CHAPTER_ONLY]} "
                f"章尚无实验，{counts[STATUS_PLANNED]} 章仍在计划中（此表在构建网站时根据"
                "仓库中现有的章节与实验自动生成）。")
    else:
        head = (f"{counts[STATUS_AVAILABLE]} chapters with their lab are available, "
                f"{counts[STATUS_CHAPTER_ONLY]} without a lab yet, and "
                f"{counts[STATUS_PLANNED]} are planned (this table is generated from the "
                "chapters and labs present in the repository when the site is built).")
    return head + "\n" + "\n".join(out) + "\n"


# ------------------------------------------------------------------ claims and measurements

_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _md_cell(text: str, markdown: bool) -> str:
    """A claims row's cell for a Markdown table. Text from Markdown (a Markdown cell, or a
    table the chapter printed in Markdown) keeps its markup; a ``|`` that is not escaped
    and not in a code span is escaped (``max |Δ|`` would split the cell). Plain printed
    text is escaped whole, ``$`` included (no formula)."""
    text = " ".join(text.split())
    if not markdown:
        text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        return re.sub(r"([\\`*_\[\]|$])", r"\\\1", text)
    out, pos = [], 0
    for m in _CODE_SPAN.finditer(text):
        out.append(re.sub(r"(?<!\\)\|", r"\\|", text[pos:m.start()]))
        out.append(m.group(0))
        pos = m.end()
    out.append(re.sub(r"(?<!\\)\|", r"\\|", text[pos:]))
    return "".join(out)


def chapter_claims(lang: str = "en") -> dict[int, claims.Section]:
    """Chapter number -> its claims section, from the executed notebooks as the pages in
    ``lang`` show them (``on_files`` has written them). A chapter without readable rows
    fails the build."""
    out = {}
    for n, src in sorted(chapters_on_disk().items()):
        try:
            out[n] = claims.chapter_claims(localized_path(src, lang),
                                           english=localized_path(src, "en"))
        except (claims.ClaimsError, OSError) as e:
            raise PluginError(f"claims page, chapter {n}: {e}") from e
    return out


def claims_markdown(page) -> str:
    """Every chapter's claim-vs-measurement rows, by stage and chapter; the first cell of
    each row links to the chapter's own section."""
    zh = page_lang(page) == "zh"
    chapters, sections = chapters_on_disk(), chapter_claims("zh" if zh else "en")
    stage_of = {n: stage for stage, n, _, _ in syllabus_rows()}
    stages_zh = dict(zip((st for st, _ in SYLLABUS), SYLLABUS_ZH))
    total = sum(len(s.rows) for s in sections.values())
    if zh:
        out = [f"以下 {len(sections)} 章共 {total} 行，均在构建网站时从已执行的 notebook 中读取"
               "（`docs/claims.py`），与各章中文页面显示的表格相同；每行第一列链接到该章的对应小节。"]
    else:
        out = [f"{total} rows from {len(sections)} chapters, read from the executed notebooks "
               "when the site was built (`docs/claims.py`); the first cell of each row links "
               "to the chapter's own section."]
    stage_now = None
    for n, sec in sections.items():
        if stage_of.get(n) != stage_now:
            stage_now = stage_of.get(n)
            out += ["", f"## {stages_zh.get(stage_now, stage_now) if zh else stage_now}"]
        link = (_rel(page, chapter_uri(chapters[n], "zh" if zh else "en")) + "#"
                + claims.heading_anchor(sec.heading))
        out += ["", f"### {n}. {_chapter_title(n, 'zh' if zh else 'en')}", "",
                '<div class="claims-table" markdown>', "",  # its column widths: extra.css
                ("| 章 | 论断（出处） | 本章实测 |" if zh else
                 "| ch. | claim (source) | measured in the chapter |"), "|---|---|---|"]
        for row in sec.rows:
            claim = _md_cell(row.claim, row.markdown)
            if row.source:
                claim += f" ({_md_cell(row.source, row.markdown)})"
            out.append(f"| [{n}]({link}) | {claim} | {_md_cell(row.measured, row.markdown)} |")
        out += ["", "</div>"]
    return "\n".join(out) + "\n"


def labs_markdown(page) -> str:
    rows = ["| lab | chapter | source |", "|---|---|---|"]
    chapters = chapters_on_disk()
    for n, src in sorted(labs_on_disk().items()):
        ch = (f"[{n}. {_chapter_title(n)}]({_rel(page, chapter_uri(chapters[n]))})"
              if n in chapters else f"{n}. {_chapter_title(n)}")
        rows.append(f"| [Lab {n}]({_rel(page, lab_uri(n))}) | {ch} | `{src.relative_to(ROOT)}` |")
    return "\n".join(rows) + "\n"


def module_map_markdown() -> str:
    """The "## Module map" section of README.md, without its heading (one copy: README)."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^## Module map\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    if not m:
        raise PluginError("README.md has no '## Module map' section")
    return m.group(1).strip() + "\n"


def _points_table(cells) -> list[tuple[str, float, bool]]:
    out = []
    for c in cells:
        meta = c.metadata.get("nbgrader", {})
        if c.cell_type == "code" and meta.get("grade"):
            out.append((meta["grade_id"], float(meta.get("points", 0)),
                        "### BEGIN HIDDEN TESTS" in c.source))
    return out


def _signatures(source: str) -> str:
    """The ``def`` lines of a solution cell (what the learner writes), no body."""
    return "\n".join(m.group(0) + " ..." for m in
                     re.finditer(r"^def \w+\(.*?\)(?:\s*->\s*[^:]+)?:", source, re.M | re.S))


def _timeout() -> str:
    text = (ROOT / "grading" / "nbgrader_config.py").read_text()
    m = re.search(r"^c\.Execute\.timeout\s*=\s*(\d+)", text, re.M)
    return m.group(1) if m else "?"


# The generated parts of a lab page, in each language.
LAB_TEXT = {
    "en": {
        "you_write": "You write (cell `{gid}`):",
        "graded_by": "Graded by: ",
        "graded_cell": "`{gid}` ({pts:g} point{s}, {kind})",
        "hidden": "hidden tests", "visible": "visible tests",
        "working": "## Working on the lab",
        "working_text": (
            "The source is `{rel}`. Run `make lab`: it converts the labs and releases "
            "them to a local exchange, then starts JupyterLab at the repository root. "
            "Fetch the lab from nbgrader's *Assignment List* (or right-click the `.py` source, "
            "*Open With > Notebook*, to read it with its solutions), run the cells in "
            "order, fill in the cells marked `# YOUR CODE HERE`, and use *Validate* "
            "before you submit."),
        "grading": "## Grading",
        "cells": "{k} autograded cells, {total:g} points in all:",
        "table": ["| test cell | points | |", "|---|---|---|"],
        "hidden_row": "hidden tests (added back when grading)", "visible_row": "visible",
        "how": (
            "The autograder (`nbgrader autograde`) restores the hidden tests, runs every "
            "cell of the submission from the top with a limit of {timeout} s per cell "
            "(`grading/nbgrader_config.py`), and calls your functions on inputs that are not "
            "in the notebook, comparing with a reference it computes itself: a stored number "
            "or a function that only works on the examples scores nothing. A failing test "
            "cell prints what was expected, what was measured and by how much it missed."),
        "fixtures": ("CI grades this lab against fixture submissions "
                     "(`grading/fixtures/ch{n:02d}.py`), each with its exact expected score:"),
        "fixtures_table": ["| fixture submission | expected score |", "|---|---|"],
        "make_grade": ("`make grade` runs the whole check: see the "
                       "[instructor guide]({guide})."),
        "title": "# Lab {n}\n",
    },
    "zh": {
        "you_write": "你要编写（单元 `{gid}`）：",
        "graded_by": "评分单元：",
        "graded_cell": "`{gid}`（{pts:g} 分，{kind}）",
        "hidden": "隐藏测试", "visible": "可见测试",
        "working": "## 完成实验",
        "working_text": (
            "源文件是 `{rel}`。运行 `make lab`：它会转换各个实验并发布到本地的交换目录，然后在"
            "仓库根目录启动 JupyterLab（`make lab COURSE_LANG=zh` 发布中文版，作业名称、单元、"
            "分值与测试都与英文版相同）。从 nbgrader 的 *Assignment List* 中获取实验（或右键单击 "
            "`.py` 源文件，选择 *Open With > Notebook*，连同参考答案一起阅读），按顺序运行各单元，"
            "填写标有 `# YOUR CODE HERE` 的单元，提交前先用 *Validate* 检查。"),
        "grading": "## 评分",
        "cells": "共 {k} 个自动评分单元，总分 {total:g} 分：",
        "table": ["| 测试单元 | 分值 | |", "|---|---|---|"],
        "hidden_row": "隐藏测试（评分时加回）", "visible_row": "可见",
        "how": (
            "自动评分器（`nbgrader autograde`）会恢复隐藏测试，从头运行提交的每个单元，每个单元限时 "
            "{timeout} 秒（`grading/nbgrader_config.py`），并在 notebook 中没有出现过的输入上调用你的"
            "函数，与它自己计算的参考结果比较：存下来的数字，或者只在示例上成立的函数，都得不到分。"
            "未通过的测试单元会打印期望值、实测值以及相差多少。"),
        "fixtures": ("CI 用若干份固定的提交（`grading/fixtures/ch{n:02d}.py`）为本实验评分，"
                     "每份都有确切的预期得分："),
        "fixtures_table": ["| 固定提交 | 预期得分 |", "|---|---|"],
        "make_grade": "`make grade` 运行完整的检查：见[教师指南]({guide})（英文）。",
        "title": "# 实验 {n}\n",
    },
}


def lab_page(n: int, src: Path, lang: str = "en") -> str:
    """A lab's page: its own text (task by task, with the graded cells and their points),
    how to open it, and how it is graded. Solutions and test code are not shown. In
    Chinese (``lang="zh"``): the lab's translated Markdown (docs/i18n.py; an untranslated
    cell shows its English under a mark) and the generated parts in Chinese."""
    import jupytext

    T = LAB_TEXT[lang]
    nb = jupytext.read(src) if lang == "en" else i18n.localize(jupytext.read(src), src, lang)
    rel = src.relative_to(ROOT)
    lines: list[str] = []
    graded = _points_table(nb.cells)
    total = sum(p for _, p, _ in graded)
    pending: list[str] = []  # the graded cells of the task being written out

    def flush():
        if pending:
            lines.extend(["", T["graded_by"] + "; ".join(pending) + ("。" if lang == "zh" else "."), ""])
            pending.clear()

    for c in nb.cells:
        meta = c.metadata.get("nbgrader", {})
        if c.cell_type == "markdown":
            flush()
            lines += [c.source, ""]
        elif meta.get("solution"):
            sig = _signatures(c.source)
            if sig:
                lines += [T["you_write"].format(gid=meta["grade_id"]), "", "```python",
                          sig, "```", ""]
        elif meta.get("grade"):
            kind = T["hidden"] if "### BEGIN HIDDEN TESTS" in c.source else T["visible"]
            pts = float(meta.get("points", 0))
            pending.append(T["graded_cell"].format(gid=meta["grade_id"], pts=pts,
                                                   s="s" if pts != 1 else "", kind=kind))
    flush()
    if not lines or not lines[0].startswith("# "):
        lines.insert(0, T["title"].format(n=n))

    lines += [T["working"], "", T["working_text"].format(rel=rel), ""]
    lines += [T["grading"], "", T["cells"].format(k=len(graded), total=total), ""]
    lines += T["table"]
    lines += [f"| `{g}` | {p:g} | {T['hidden_row'] if h else T['visible_row']} |"
              for g, p, h in graded]
    lines += ["", T["how"].format(timeout=_timeout()), ""]
    fixtures = _fixtures(n)
    if fixtures:
        lines += [T["fixtures"].format(n=n), ""]
        lines += T["fixtures_table"]
        lines += [f"| {name} | {score:g} / {fixtures['max']:g} |"
                  for name, score in fixtures["scores"].items()]
        guide = "../../instructor.md" if lang == "zh" else "../instructor.md"
        lines += ["", T["make_grade"].format(guide=guide)]
    return "\n".join(lines) + "\n"


def _fixtures(n: int) -> dict | None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        mod = importlib.import_module(f"grading.fixtures.ch{n:02d}")
    except ModuleNotFoundError:
        return None
    return {"max": float(mod.MAX_SCORE),
            "scores": {k: float(v[2]) for k, v in mod.FIXTURES.items()}}


if __name__ == "__main__":  # python docs/hooks.py: the syllabus status as JSON
    print(json.dumps([dict(zip(("stage", "n", "title", "status"), r))
                      for r in syllabus_rows()], indent=1))
