/* Interactive figures of "Multi-head attention, proven".
 *
 * Every element with a data-explorer="<name>" attribute holds, in a
 * <script type="application/json" class="explorer-data">, the numbers a notebook
 * cell computed with attnlib (attnlib/explorers.py), and a static PNG of the default
 * view. This script replaces the PNG by a drawing with native, labelled controls
 * and redraws when a control changes. It fetches nothing: the page works offline
 * and from file://.
 *
 * Hand-written on purpose, not a plotting library: each figure is a few dozen SVG
 * rectangles, lines and labels, and this whole file is smaller than a tenth of
 * plotly.min.js (about 3.5 MB), which would have to be served with every page. Plain
 * DOM code also gives us native <select>/<input type="range">/<button> controls
 * that are keyboard-operable and labelled for screen readers without extra work.
 */
(function () {
  "use strict";

  var SVG_NS = "http://www.w3.org/2000/svg";

  /* ---- small helpers ------------------------------------------------------- */
  function el(tag, attrs, parent, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }

  function svg(tag, attrs, parent, text) {
    var node = document.createElementNS(SVG_NS, tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }

  /* attnlib.explorers.round_array stores numbers as {"e": e, "m": [ints]}: m * 10^e. */
  function unround(r) {
    var f = Math.pow(10, r.e);
    return r.m.map(function (v) { return v * f; });
  }

  function softmax(row) {
    var top = Math.max.apply(null, row);
    var e = row.map(function (s) { return Math.exp(s - top); });
    var sum = e.reduce(function (a, b) { return a + b; }, 0);
    return e.map(function (x) { return x / sum; });
  }

  function fmt(x, digits) { return x.toFixed(digits); }

  /* A labelled <select> with the given option texts; returns the select. */
  function selectControl(parent, id, label, options, value) {
    var wrap = el("div", { "class": "explorer-control" }, parent);
    el("label", { "for": id }, wrap, label);
    var sel = el("select", { id: id }, wrap);
    options.forEach(function (text, i) { el("option", { value: String(i) }, sel, text); });
    sel.value = String(value);
    return sel;
  }

  /* A labelled range slider with an <output> that shows its value in words. */
  function rangeControl(parent, id, label, min, max, value) {
    var wrap = el("div", { "class": "explorer-control explorer-range" }, parent);
    el("label", { "for": id }, wrap, label);
    var input = el("input", { id: id, type: "range", min: String(min), max: String(max),
                              step: "1" }, wrap);
    input.value = String(value);
    var out = el("output", { "for": id, id: id + "-value" }, wrap);
    return { input: input, output: out };
  }

  /* ---- chapter 1: the soft look-up's sharpness ------------------------------ */
  function sharpness(root, data) {
    var nK = data.keys.length, nB = data.betas.length, dv = data.dv;
    var reads = unround(data.reads), values = unround(data.values);
    var state = { q: data["default"][0], b: data["default"][1] };
    var id = root.id;

    var controls = el("div", { "class": "explorer-controls" }, root);
    var query = selectControl(controls, id + "-query", "query", data.queries, state.q);
    var beta = rangeControl(controls, id + "-beta", "sharpness β", 0, nB - 1, state.b);

    var W = 360, row = 30, left = 64, barW = 210;
    var fig = svg("svg", { "class": "explorer-figure", viewBox: "0 0 " + W + " " + (row * nK + 30),
                           role: "img" }, root);
    var readout = el("p", { "class": "explorer-readout", "aria-live": "polite" }, root);

    function draw() {
      var w = data.weights.slice((state.q * nB + state.b) * nK, (state.q * nB + state.b + 1) * nK);
      var best = w.indexOf(Math.max.apply(null, w));
      var betaText = "β = " + data.betas[state.b];
      beta.output.textContent = betaText;
      beta.input.setAttribute("aria-valuetext", betaText);
      while (fig.firstChild) fig.removeChild(fig.firstChild);
      svg("title", {}, fig, "Weights of the look-up of " + data.queries[state.q] + " at " + betaText);
      svg("text", { x: left, y: 14, "class": "explorer-axis" }, fig, "weight on each key (0 to 1)");
      data.keys.forEach(function (key, j) {
        var y = 24 + j * row;
        svg("text", { x: left - 8, y: y + row / 2 + 4, "text-anchor": "end",
                      "class": "explorer-label" }, fig, key);
        svg("rect", { x: left, y: y + 4, width: barW, height: row - 10, "class": "explorer-track" }, fig);
        svg("rect", { x: left, y: y + 4, width: fmt(barW * w[j], 2), height: row - 10,
                      "class": j === best ? "explorer-bar explorer-best" : "explorer-bar" }, fig);
        svg("text", { x: left + barW + 6, y: y + row / 2 + 4, "class": "explorer-label" },
            fig, fmt(w[j], 3));
      });
      var r = reads.slice((state.q * nB + state.b) * dv, (state.q * nB + state.b + 1) * dv);
      var v = values.slice(best * dv, (best + 1) * dv);
      readout.textContent = data.queries[state.q] + " at " + betaText + " reads [" +
        r.map(function (x) { return fmt(x, 2); }).join(", ") + "]; the most weight, " +
        fmt(w[best], 3) + ", is on " + data.keys[best] + ", whose value is [" +
        v.map(function (x) { return fmt(x, 0); }).join(", ") + "].";
    }
    query.addEventListener("change", function () { state.q = +query.value; draw(); });
    beta.input.addEventListener("input", function () { state.b = +beta.input.value; draw(); });
    draw();
  }

  /* ---- chapter 6: every head of a trained model, at every rank of W^QK -------- */
  function heads(root, data) {
    var id = root.id, R = data.rank;
    var state = { s: 0, l: data["default"][0], h: data["default"][1], r: R, q: 1 };
    var cache = {};  // unrounded factors per sentence/layer/head

    function factors() {
      var key = state.s + "/" + state.l + "/" + state.h;
      if (!cache[key]) {
        var e = data.sentences[state.s][state.l][state.h];
        cache[key] = { p: unround(e.p), k: unround(e.k), c: unround(e.c) };
      }
      return cache[key];
    }

    /* The head's map at rank r: s_ij = sum_{a<r} P_ia K_ja + c_j, softmax over j
       (see attnlib.explorers.head_explorer for why this is the head's map). */
    function map() {
      var f = factors(), t = data.tokens[state.s].length, rows = [];
      for (var i = 0; i < t; i++) {
        var s = [];
        for (var j = 0; j < t; j++) {
          var acc = f.c[j];
          for (var a = 0; a < state.r; a++) acc += f.p[i * R + a] * f.k[j * R + a];
          s.push(acc);
        }
        rows.push(softmax(s));
      }
      return rows;
    }

    var controls = el("div", { "class": "explorer-controls" }, root);
    var sentence = selectControl(controls, id + "-sentence", "sentence",
      data.tokens.map(function (t) { return t.join(" "); }), state.s);
    var layers = [], headNames = [];
    for (var l = 0; l < data.layers; l++) layers.push(String(l));
    for (var h = 0; h < data.heads; h++) headNames.push(String(h));
    var layer = selectControl(controls, id + "-layer", "layer", layers, state.l);
    var head = selectControl(controls, id + "-head", "head", headNames, state.h);
    var rank = rangeControl(controls, id + "-rank", "rank of W^QK", 1, R, R);

    var tokenBar = el("div", { "class": "explorer-tokens", role: "group",
                               "aria-label": "reading token (query)" }, root);
    el("span", { "class": "explorer-tokens-label", "aria-hidden": "true" }, tokenBar, "reading token:");
    var panels = el("div", { "class": "explorer-panels" }, root);
    var lines = svg("svg", { "class": "explorer-figure explorer-lines", role: "img" }, panels);
    var heat = svg("svg", { "class": "explorer-figure explorer-heat", role: "img" }, panels);
    var readout = el("p", { "class": "explorer-readout", "aria-live": "polite" }, root);
    var buttons = [];

    function makeTokens() {
      buttons.forEach(function (b) { tokenBar.removeChild(b); });
      var toks = data.tokens[state.s];
      state.q = Math.min(state.q, toks.length - 1);
      buttons = toks.map(function (tok, i) {
        var b = el("button", { type: "button", "class": "explorer-token",
                               "aria-label": "token " + i + ": " + tok }, tokenBar, tok);
        function pick() { if (state.q !== i) { state.q = i; draw(); } }
        b.addEventListener("click", pick);
        b.addEventListener("focus", pick);
        return b;
      });
    }

    function draw() {
      var toks = data.tokens[state.s], t = toks.length, A = map(), w = A[state.q];
      var rankText = state.r === R ? R + " (full)" : String(state.r);
      rank.output.textContent = rankText;
      rank.input.setAttribute("aria-valuetext", "rank " + rankText);
      buttons.forEach(function (b, i) { b.setAttribute("aria-pressed", String(i === state.q)); });
      var what = "layer " + state.l + ", head " + state.h + ", rank " + rankText;

      // Lines, bertviz-style: the reading token on the left, every token it reads on the right.
      var rowH = 24, W = 300, top = 22, H = top + rowH * t + 4, x0 = 96, x1 = 204;
      lines.setAttribute("viewBox", "0 0 " + W + " " + H);
      while (lines.firstChild) lines.removeChild(lines.firstChild);
      svg("title", {}, lines, "Where " + toks[state.q] + " reads, " + what);
      svg("text", { x: x0, y: 12, "text-anchor": "end", "class": "explorer-axis" }, lines, "reads");
      svg("text", { x: x1, y: 12, "class": "explorer-axis" }, lines, "from");
      toks.forEach(function (tok, j) {
        var y = top + rowH * j + rowH / 2;
        svg("text", { x: x0 - 6, y: y + 4, "text-anchor": "end",
                      "class": j === state.q ? "explorer-label explorer-current" : "explorer-label explorer-dim" },
            lines, tok);
        svg("line", { x1: x0, y1: top + rowH * state.q + rowH / 2, x2: x1, y2: y,
                      "class": "explorer-link", "stroke-width": fmt(0.5 + 7 * w[j], 2),
                      "stroke-opacity": fmt(0.08 + 0.92 * w[j], 3) }, lines);
        svg("text", { x: x1 + 6, y: y + 4, "class": "explorer-label" }, lines,
            tok + " " + fmt(w[j], 2));
      });

      // The whole map: rows read, columns are read; the current row outlined.
      var cell = 22, lab = 78, Wh = lab + cell * t + 6, Hh = lab + cell * t + 6;
      heat.setAttribute("viewBox", "0 0 " + Wh + " " + Hh);
      while (heat.firstChild) heat.removeChild(heat.firstChild);
      svg("title", {}, heat, "Attention map, " + what);
      toks.forEach(function (tok, i) {
        svg("text", { x: lab - 4, y: lab + cell * i + cell / 2 + 4, "text-anchor": "end",
                      "class": "explorer-label" }, heat, tok);
        svg("text", { x: 0, y: 0, "class": "explorer-label",
                      transform: "translate(" + (lab + cell * i + cell / 2 + 4) + "," + (lab - 4) + ") rotate(-90)" },
            heat, tok);
        for (var j = 0; j < t; j++) {
          svg("rect", { x: lab + cell * j, y: lab + cell * i, width: cell, height: cell,
                        "class": "explorer-cell", "fill-opacity": fmt(A[i][j], 3) }, heat);
        }
      });
      svg("rect", { x: lab, y: lab + cell * state.q, width: cell * t, height: cell,
                    "class": "explorer-row" }, heat);

      var best = w.indexOf(Math.max.apply(null, w));
      readout.textContent = what + ": “" + toks[state.q] + "” puts " + fmt(w[best], 2) +
        " of its weight on “" + toks[best] + "”.";
    }

    sentence.addEventListener("change", function () { state.s = +sentence.value; makeTokens(); draw(); });
    layer.addEventListener("change", function () { state.l = +layer.value; draw(); });
    head.addEventListener("change", function () { state.h = +head.value; draw(); });
    rank.input.addEventListener("input", function () { state.r = +rank.input.value; draw(); });
    makeTokens();
    draw();
  }

  /* ---- chapter 10: the online softmax, one block of keys at a time ---------- */
  function onlineSoftmax(root, data) {
    var id = root.id, nK = data.scores.length, dv = data.dv;
    var state = { b: data["default"][0], t: data["default"][1] };
    function nBlocks() { return Math.ceil(nK / data.blocks[state.b]); }

    var controls = el("div", { "class": "explorer-controls" }, root);
    var block = selectControl(controls, id + "-block", "block size",
      data.blocks.map(function (b) { return b + (b === 1 ? " key" : " keys"); }), state.b);
    var step = rangeControl(controls, id + "-step", "blocks visited", 0, nBlocks(), state.t);

    var W = 380, H = 190, left = 40, right = 12, top = 18, bottom = 34;
    var fig = svg("svg", { "class": "explorer-figure explorer-wide", viewBox: "0 0 " + W + " " + H,
                           role: "img" }, root);
    var readout = el("p", { "class": "explorer-readout", "aria-live": "polite" }, root);
    var lo = Math.min(0, Math.min.apply(null, data.scores)), hi = Math.max(0, Math.max.apply(null, data.scores));
    var pad = 0.08 * (hi - lo || 1);
    lo -= pad; hi += pad;
    function y(v) { return top + (hi - v) / (hi - lo) * (H - top - bottom); }
    var slot = (W - left - right) / nK;

    function vec(v) { return "[" + v.map(function (x) { return fmt(x, 3); }).join(", ") + "]"; }

    function draw() {
      var b = data.blocks[state.b], t = state.t, s = data.steps[state.b];
      var seen = Math.min(t * b, nK), first = Math.max(0, (t - 1) * b);
      var text = t + " of " + nBlocks();
      step.output.textContent = text;
      step.input.setAttribute("aria-valuetext", text + " blocks visited, " + seen + " keys seen");
      while (fig.firstChild) fig.removeChild(fig.firstChild);
      svg("title", {}, fig, "Scores of one query, visited in blocks of " + b + "; " + seen + " of " + nK + " keys seen");
      svg("text", { x: left, y: 12, "class": "explorer-axis" }, fig, "score s_j");
      svg("line", { x1: left, x2: W - right, y1: fmt(y(0), 2), y2: fmt(y(0), 2), "class": "explorer-zero" }, fig);
      data.scores.forEach(function (v, j) {
        var x = left + j * slot + 1.5, y0 = y(Math.max(v, 0)), h = Math.abs(y(v) - y(0));
        var cls = j >= seen ? "explorer-track" : j >= first ? "explorer-bar explorer-best" : "explorer-bar";
        svg("rect", { x: fmt(x, 2), y: fmt(y0, 2), width: fmt(slot - 3, 2), height: fmt(Math.max(h, 0.5), 2),
                      "class": cls }, fig);
        if (nK <= 16 || j % 4 === 0) {  // every key's number, or every fourth one
          svg("text", { x: fmt(x + (slot - 3) / 2, 2), y: H - bottom + 14, "text-anchor": "middle",
                        "class": "explorer-label" }, fig, String(j));
        }
      });
      for (var k = b; k < nK; k += b) {
        var xs = fmt(left + k * slot, 2);
        svg("line", { x1: xs, x2: xs, y1: top, y2: H - bottom, "class": "explorer-sep" }, fig);
      }
      svg("text", { x: (left + W - right) / 2, y: H - 4, "text-anchor": "middle", "class": "explorer-axis" },
          fig, "key j, visited left to right");
      var yTop = fmt(y(hi - pad), 2), yBottom = fmt(y(lo + pad), 2);
      svg("text", { x: left - 4, y: yTop, "text-anchor": "end", "class": "explorer-axis" }, fig, fmt(hi - pad, 1));
      svg("text", { x: left - 4, y: yBottom, "text-anchor": "end", "class": "explorer-axis" }, fig, fmt(lo + pad, 1));
      if (t > 0) {
        var ym = fmt(y(s.m[t]), 2);
        svg("line", { x1: left, x2: W - right, y1: ym, y2: ym, "class": "explorer-max" }, fig);
        svg("text", { x: W - right, y: 12, "text-anchor": "end", "class": "explorer-label" },
            fig, "dashed: running max m = " + fmt(s.m[t], 3));
      }
      var last = s.out[s.out.length - 1];
      if (t === 0) {
        readout.textContent = "No key visited yet: m = −∞, running sum ℓ = 0, partial output 0. " +
          "With all " + nK + " keys the output is " + vec(last) + ".";
        return;
      }
      var keys = seen - 1 === first ? "key " + first : "keys " + first + "–" + (seen - 1);
      var msg = "After block " + t + " of " + nBlocks() + " (" + keys + "): " +
        "running max m = " + fmt(s.m[t], 3);
      if (t > 1 && s.m[t] > s.m[t - 1]) {
        msg += ", up from " + fmt(s.m[t - 1], 3) + ", so the earlier sum and output were rescaled by e^(" +
          fmt(s.m[t - 1], 3) + " − " + fmt(s.m[t], 3) + ") = " + fmt(Math.exp(s.m[t - 1] - s.m[t]), 3);
      } else if (t > 1) {
        msg += " (unchanged: no rescale)";
      }
      msg += "; running sum ℓ = " + fmt(s.ell[t], 3) + "; partial output " + vec(s.out[t]) +
        (t === nBlocks() ? ", the attention output." : "; with all " + nK + " keys: " + vec(last) + ".");
      readout.textContent = msg;
    }
    block.addEventListener("change", function () {
      var frac = state.t / nBlocks();
      state.b = +block.value;
      state.t = Math.round(frac * nBlocks());
      step.input.max = String(nBlocks());
      step.input.value = String(state.t);
      draw();
    });
    step.input.addEventListener("input", function () { state.t = +step.input.value; draw(); });
    draw();
  }

  /* ---- chapter 11: how layer 1's heads read layer 0's (composition scores) ---- */
  function composition(root, data) {
    var id = root.id, H = data.heads;
    var state = { r: data["default"][0], k: data["default"][1] };
    var top = 0;  // one colour scale for every view: the largest score embedded
    data.scores.forEach(function (run) { run.forEach(function (m) { m.forEach(function (row) {
      row.forEach(function (x) { top = Math.max(top, x); }); }); }); });
    var controls = el("div", { "class": "explorer-controls" }, root);
    var seed = selectControl(controls, id + "-seed", "seed",
      data.seeds.map(function (s) { return String(s); }), state.r);
    var kind = selectControl(controls, id + "-kind", "composition",
      data.kinds.map(function (k) { return k + " (layer 1 reads it through its " +
        { Q: "queries", K: "keys", V: "values" }[k] + ")"; }), state.k);
    var cell = 64, lab = 92, W = lab + cell * H + 8;
    var fig = svg("svg", { "class": "explorer-figure", viewBox: "0 0 " + W + " " + (lab + cell * H + 8),
                           role: "img" }, root);
    var readout = el("p", { "class": "explorer-readout", "aria-live": "polite" }, root);

    function draw() {
      var m = data.scores[state.r][state.k], what = "seed " + data.seeds[state.r] + ", " +
        data.kinds[state.k] + "-composition";
      while (fig.firstChild) fig.removeChild(fig.firstChild);
      svg("title", {}, fig, "Composition scores, " + what);
      svg("text", { x: lab, y: 14, "class": "explorer-axis" }, fig, "reader: layer-1 head");
      var best = [0, 0];
      for (var i = 0; i < H; i++) {
        svg("text", { x: lab - 6, y: lab + cell * i + cell / 2 + 4, "text-anchor": "end",
                      "class": "explorer-label" }, fig, "L0 head " + i);
        svg("text", { x: lab + cell * i + cell / 2, y: lab - 8, "text-anchor": "middle",
                      "class": "explorer-label" }, fig, "L1 head " + i);
        for (var j = 0; j < H; j++) {
          if (m[i][j] > m[best[0]][best[1]]) best = [i, j];
          svg("rect", { x: lab + cell * j, y: lab + cell * i, width: cell, height: cell,
                        "class": "explorer-cell", "fill-opacity": fmt(0.6 * m[i][j] / top, 3) }, fig);
          svg("text", { x: lab + cell * j + cell / 2, y: lab + cell * i + cell / 2 + 4, "text-anchor": "middle",
                        "class": "explorer-label" }, fig, fmt(m[i][j], 3));
        }
      }
      svg("text", { x: 4, y: lab - 24, "class": "explorer-axis" }, fig, "writer: layer-0 head");
      readout.textContent = what + ": the largest score is " + fmt(m[best[0]][best[1]], 3) +
        ", layer-0 head " + best[0] + " into layer-1 head " + best[1] + "; random matrices of these shapes score " +
        fmt(data.control[0], 3) + " to " + fmt(data.control[1], 3) + ".";
    }
    seed.addEventListener("change", function () { state.r = +seed.value; draw(); });
    kind.addEventListener("change", function () { state.k = +kind.value; draw(); });
    draw();
  }

  /* ---- start every explorer on the page ------------------------------------- */
  var KINDS = { sharpness: sharpness, heads: heads, "online-softmax": onlineSoftmax, composition: composition };

  function start(root) {
    var kind = KINDS[root.getAttribute("data-explorer")];
    var script = root.querySelector("script.explorer-data");
    if (!kind || !script || root.classList.contains("explorer-ready")) return;
    var data = JSON.parse(script.textContent);
    root.querySelectorAll(".explorer-fallback").forEach(function (n) { n.remove(); });
    kind(root, data);
    root.classList.add("explorer-ready");
  }

  function startAll() { document.querySelectorAll("[data-explorer]").forEach(start); }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", startAll);
  else startAll();
})();
