// MathJax 3 for pymdownx.arithmatex (generic mode), as in mkdocs-material's recipe, and
// for the Markdown cells of the chapter notebooks ($...$, as Jupyter writes math).
window.MathJax = {
  tex: { inlineMath: [["\\(", "\\)"], ["$", "$"]], displayMath: [["\\[", "\\]"], ["$$", "$$"]],
         processEscapes: true, processEnvironments: true },
  options: { ignoreHtmlClass: ".*|", processHtmlClass: "arithmatex|jp-MarkdownOutput" }
};
document$.subscribe(() => {
  if (window.MathJax && MathJax.typesetPromise) {
    MathJax.startup.output.clearCache(); MathJax.typesetClear(); MathJax.texReset();
    MathJax.typesetPromise();
  }
});
