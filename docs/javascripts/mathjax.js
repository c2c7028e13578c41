// MathJax 3 for pymdownx.arithmatex (generic mode), as in mkdocs-material's recipe, and
// for the Markdown cells of the chapter notebooks ($...$, as Jupyter writes math).
// MathJax itself is served with the site (javascripts/mathjax/, from the docs extra's
// django-static-mathjax; see docs/hooks.py): no CDN, so pages render math offline.
window.MathJax = {
  tex: { inlineMath: [["\\(", "\\)"], ["$", "$"]], displayMath: [["\\[", "\\]"], ["$$", "$$"]],
         processEscapes: true, processEnvironments: true },
  options: { ignoreHtmlClass: ".*|", processHtmlClass: "arithmatex|jp-MarkdownOutput" }
};
// MathJax typesets the page it loads on by itself. A later page (mkdocs-material's instant
// navigation, if it is turned on) is typeset here, once MathJax's startup is done. Typesetting
// the first page a second time would also render the MathML that MathJax adds next to each
// formula for screen readers: a loaded-from-disk MathJax can be ready before this fires.
let firstPage = true;
document$.subscribe(() => {
  if (firstPage) { firstPage = false; return; }
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    MathJax.startup.promise = MathJax.startup.promise.then(() => {
      MathJax.startup.output.clearCache(); MathJax.typesetClear(); MathJax.texReset();
      return MathJax.typesetPromise();
    });
  }
});
