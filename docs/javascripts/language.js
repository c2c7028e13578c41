// The language selector (mkdocs.yml extra.alternate) keeps the reader on the same page:
// a page's counterpart is the same path with or without the leading "zh/" (the Chinese
// edition: docs/zh/ and the chapter and lab pages docs/hooks.py generates under zh/).
// mkdocs-material does this from sitemap.xml, which mkdocs leaves empty without a
// site_url (the site works from any address, so it has none); a page with no counterpart
// (the API reference has no Chinese edition) leads to the other language's home page.
document.addEventListener("click", async (event) => {
  const link = event.target instanceof Element && event.target.closest(".md-select a[hreflang]");
  if (!link || event.metaKey || event.ctrlKey) return;
  event.preventDefault();
  event.stopPropagation();  // before mkdocs-material's own handler (on document.body)
  const config = JSON.parse(document.getElementById("__config").textContent);
  const root = new URL(config.base.replace(/\/?$/, "/"), location.href);
  let path = location.href.slice(root.href.length).split("#")[0];
  path = path.replace(/^zh(\/|$)/, "");
  const target = new URL((link.hreflang === "zh" ? "zh/" : "") + path, root);
  const home = new URL(link.hreflang === "zh" ? "zh/" : "./", root);
  let ok = false;
  try { ok = (await fetch(target, { method: "HEAD" })).ok; } catch (e) { ok = false; }
  location.href = (ok ? target : home).href;
}, true);
