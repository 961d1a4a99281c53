// lenskit's interactive view: lens tables (hover a cell for its top-k, click to pin) and attention patterns
// (a grid of heads; click one for its pattern with token labels). Reads the JSON in the script tag beside it.
(function () {
  "use strict";
  const root = document.currentScript.closest(".lkv");
  const data = JSON.parse(root.querySelector("script.lkv-data").textContent);
  const tip = root.querySelector(".tip");
  const make = (tag, attrs, text) => {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const blue = (v) => `rgba(8, 48, 107, ${Math.max(0, Math.min(1, v)).toFixed(3)})`;
  const ink = (v) => (v > 0.55 ? "#fff" : "#111");

  for (const lens of data.lenses) {
    const sec = root.querySelector(`section.lens[data-lens="${CSS.escape(lens.name)}"]`);
    const pins = sec.querySelector(".pins");
    sec.querySelectorAll("td.cell").forEach((td) => {
      td.addEventListener("mousemove", (ev) => {
        tip.textContent = td.title;
        tip.style.display = "block";
        tip.style.left = ev.clientX + 12 + "px";
        tip.style.top = ev.clientY + 12 + "px";
      });
      td.addEventListener("mouseleave", () => { tip.style.display = "none"; });
      td.addEventListener("click", () => {
        td.classList.toggle("pinned");
        pins.textContent = [...sec.querySelectorAll("td.cell.pinned")].map((c) => c.title).join("\n\n");
      });
    });
  }

  const att = data.attention;
  if (!att) return;
  const grid = root.querySelector(".heads");
  const detail = root.querySelector(".head-detail");
  const draw = (canvas, pattern) => {
    const n = pattern.length;
    canvas.width = n; canvas.height = n;
    const ctx = canvas.getContext("2d");
    for (let q = 0; q < n; q++) for (let k = 0; k < n; k++) {
      ctx.fillStyle = blue(pattern[q][k]);
      ctx.fillRect(k, q, 1, 1);
    }
  };
  const show = (layer, head, canvas) => {
    grid.querySelectorAll("canvas.chosen").forEach((c) => c.classList.remove("chosen"));
    canvas.classList.add("chosen");
    const pattern = att.patterns[layer][head];
    detail.replaceChildren(make("h3", {}, `layer ${att.layers ? att.layers[layer] : layer}, head ${head}: query (rows) attends to key (columns)`));
    const table = make("table", {class: "grid pattern", "data-layer": layer, "data-head": head});
    const top = make("tr"); top.appendChild(make("th"));
    att.tokens.forEach((t) => top.appendChild(make("th", {class: "key"}, t)));
    table.appendChild(top);
    pattern.forEach((row, q) => {
      const tr = make("tr"); tr.appendChild(make("th", {class: "row query"}, att.tokens[q]));
      row.forEach((v, k) => {
        const td = make("td", {class: "att", title: `${att.tokens[q]} → ${att.tokens[k]}: ${v.toFixed(3)}`});
        td.style.background = blue(v);
        td.style.color = ink(v);
        td.textContent = k <= q ? v.toFixed(2) : "";
        tr.appendChild(td);
      });
      table.appendChild(tr);
    });
    detail.appendChild(table);
  };
  grid.style.gridTemplateColumns = `auto repeat(${att.n_heads}, 58px)`;
  for (let l = 0; l < att.patterns.length; l++) {
    grid.appendChild(make("div", {class: "lab"}, `layer ${att.layers ? att.layers[l] : l}`));
    for (let h = 0; h < att.n_heads; h++) {
      const c = make("canvas", {title: `layer ${l}, head ${h}`, "data-layer": l, "data-head": h});
      draw(c, att.patterns[l][h]);
      c.addEventListener("click", () => show(l, h, c));
      grid.appendChild(c);
    }
  }
  show(0, 0, grid.querySelector("canvas"));
})();
