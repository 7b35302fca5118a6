// A small Markdown renderer for model answers that never parses model text as HTML.
//
// Every node is built with createElement and every piece of text goes in through
// textContent or a text node: an answer containing <script> or <img onerror=...>
// shows those characters and runs nothing. Links keep only http(s) and mailto URLs.
// Covers what chat answers use: fenced code, inline code, headings, lists, tables,
// quotes, paragraphs, bold, italic, strikethrough, links and horizontal rules.

const SAFE_URL = /^(https?:\/\/|mailto:)/i;

export function renderMarkdown(text) {
  const root = document.createDocumentFragment();
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*(`{3,}|~{3,})\s*([\w+#.-]*)/);
    if (fence) {
      const body = [];
      i++;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      i++; // the closing fence (or the end of an answer still streaming)
      root.append(codeBlock(body.join("\n"), fence[2]));
      continue;
    }
    if (!line.trim()) { i++; continue; }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      const h = document.createElement("h" + Math.min(heading[1].length + 2, 6));
      inline(h, heading[2]);
      root.append(h);
      i++;
      continue;
    }
    if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
      root.append(document.createElement("hr"));
      i++;
      continue;
    }
    if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])) {
      const rows = [cells(line)];
      i += 2;
      while (i < lines.length && lines[i].includes("|") && lines[i].trim()) rows.push(cells(lines[i++]));
      root.append(table(rows));
      continue;
    }
    if (/^\s*>/.test(line)) {
      const body = [];
      while (i < lines.length && /^\s*>/.test(lines[i])) body.push(lines[i++].replace(/^\s*>\s?/, ""));
      const quote = document.createElement("blockquote");
      quote.append(renderMarkdown(body.join("\n")));
      root.append(quote);
      continue;
    }
    const item = /^\s*([-*+]|\d+[.)])\s+/;
    if (item.test(line)) {
      const ordered = /^\s*\d/.test(line);
      const list = document.createElement(ordered ? "ol" : "ul");
      while (i < lines.length && item.test(lines[i])) {
        const li = document.createElement("li");
        let content = lines[i++].replace(item, "");
        while (i < lines.length && /^\s{2,}\S/.test(lines[i]) && !item.test(lines[i])) {
          content += " " + lines[i++].trim();
        }
        inline(li, content);
        list.append(li);
      }
      root.append(list);
      continue;
    }
    const para = [];
    while (i < lines.length && lines[i].trim() && !startsBlock(lines[i])) para.push(lines[i++]);
    if (!para.length) para.push(lines[i++]); // a line that looked like a block start but is not one
    const p = document.createElement("p");
    para.forEach((l, k) => {
      if (k) p.append(document.createElement("br"));
      inline(p, l);
    });
    root.append(p);
  }
  return root;
}

// A GFM table: a header row, a rule like |---|:--:|, then body rows.
const TABLE_RULE = /^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$/;

function cells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
}

function table([head, ...body]) {
  const wrap = document.createElement("div");
  wrap.className = "table";
  const t = document.createElement("table");
  const thead = document.createElement("thead");
  const tr = document.createElement("tr");
  for (const cell of head) {
    const th = document.createElement("th");
    inline(th, cell);
    tr.append(th);
  }
  thead.append(tr);
  const tbody = document.createElement("tbody");
  for (const row of body) {
    const r = document.createElement("tr");
    for (let k = 0; k < head.length; k++) {
      const td = document.createElement("td");
      inline(td, row[k] ?? "");
      r.append(td);
    }
    tbody.append(r);
  }
  t.append(thead, tbody);
  wrap.append(t);
  return wrap;
}

function startsBlock(line) {
  return /^\s*(`{3,}|~{3,}|#{1,6}\s|>|[-*+]\s|\d+[.)]\s)/.test(line);
}

function codeBlock(code, lang) {
  const wrap = document.createElement("div");
  wrap.className = "code";
  const bar = document.createElement("div");
  bar.className = "code-bar";
  const name = document.createElement("span");
  name.textContent = lang || "code";
  const copy = document.createElement("button");
  copy.type = "button";
  copy.textContent = "Copy";
  copy.addEventListener("click", () => {
    navigator.clipboard?.writeText(code).then(() => {
      copy.textContent = "Copied";
      setTimeout(() => { copy.textContent = "Copy"; }, 1200);
    }, () => {});
  });
  bar.append(name, copy);
  const pre = document.createElement("pre");
  const el = document.createElement("code");
  el.textContent = code;
  pre.append(el);
  wrap.append(bar, pre);
  return wrap;
}

// Inline spans, in order of precedence: `code`, [text](url), **bold**, *italic* / _italic_, ~~strike~~.
const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\[([^\]]+)\]\(([^)\s]+)\)|\*\*([^*]+)\*\*|__([^_]+)__|\*([^*\s][^*]*)\*|\b_([^_\s][^_]*)_\b|~~([^~]+)~~/;

function inline(parent, text) {
  while (text) {
    const m = text.match(INLINE);
    if (!m) { parent.append(document.createTextNode(text)); return; }
    if (m.index) parent.append(document.createTextNode(text.slice(0, m.index)));
    let el;
    if (m[1]) {
      el = document.createElement("code");
      el.textContent = m[2];
    } else if (m[3] !== undefined) {
      if (SAFE_URL.test(m[4])) {
        el = document.createElement("a");
        el.href = m[4];
        el.rel = "noopener noreferrer nofollow";
        el.target = "_blank";
        inline(el, m[3]);
      } else {
        el = document.createTextNode(m[0]);
      }
    } else if (m[5] !== undefined || m[6] !== undefined) {
      el = document.createElement("strong");
      inline(el, m[5] ?? m[6]);
    } else if (m[7] !== undefined || m[8] !== undefined) {
      el = document.createElement("em");
      inline(el, m[7] ?? m[8]);
    } else {
      el = document.createElement("del");
      inline(el, m[9]);
    }
    parent.append(el);
    text = text.slice(m.index + m[0].length);
  }
}
