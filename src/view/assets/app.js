// stepppo view: learning curves drawn as inline SVG, token colouring, live updates.
// Texts reach the page only through textContent or escaped server markup, never innerHTML.
(function () {
  "use strict";
  var body = document.body;

  function report(message) {
    var box = document.getElementById("errors");
    var line = document.createElement("pre");
    line.className = "js-error";
    line.textContent = "script error: " + message;
    if (box) box.appendChild(line);
    body.dataset.error = "1";
  }
  window.addEventListener("error", function (e) { report(e.message + " at " + e.filename + ":" + e.lineno); });
  window.addEventListener("unhandledrejection", function (e) { report(String(e.reason)); });

  var SVG = "http://www.w3.org/2000/svg";
  function svg(name, attrs, parent) {
    var el = document.createElementNS(SVG, name);
    Object.keys(attrs).forEach(function (k) { el.setAttribute(k, attrs[k]); });
    if (parent) parent.appendChild(el);
    return el;
  }

  var PREFERRED = [/^val\/.+\/success$/, /^env\/.+\/success$/, /^env\/.+\/reward$/, /^actor\/entropy$/,
    /^critic\/vf_explained_var$/, /^rollout\/prefix_hit_ratio$/, /^time\/step$/];

  function fmt(x) {
    var a = Math.abs(x);
    if (a !== 0 && (a < 0.01 || a >= 10000)) return x.toExponential(2);
    return String(Math.round(x * 1000) / 1000);
  }

  // One chart: a polyline over the points, each point a link to that step's trajectories.
  function chart(name, points) {
    var W = 360, H = 190, L = 52, R = 10, T = 10, B = 28;
    var fig = document.createElement("figure");
    fig.className = "chart";
    fig.dataset.metric = name;
    var cap = document.createElement("figcaption");
    cap.textContent = name;
    fig.appendChild(cap);
    var root = svg("svg", { viewBox: "0 0 " + W + " " + H, width: W, height: H, role: "img" }, fig);
    var xs = points.map(function (p) { return p[0]; }), ys = points.map(function (p) { return p[1]; });
    var x0 = Math.min.apply(null, xs), x1 = Math.max.apply(null, xs);
    var y0 = Math.min.apply(null, ys), y1 = Math.max.apply(null, ys);
    if (x1 === x0) { x1 = x0 + 1; }
    if (y1 === y0) { y1 = y0 + 1; y0 = y0 - 1; }
    function px(x) { return L + (x - x0) / (x1 - x0) * (W - L - R); }
    function py(y) { return H - B - (y - y0) / (y1 - y0) * (H - T - B); }
    svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, "class": "axis" }, root);
    svg("line", { x1: L, y1: T, x2: L, y2: H - B, "class": "axis" }, root);
    [[y0, H - B], [y1, T + 8]].forEach(function (t) {
      svg("text", { x: L - 4, y: t[1], "text-anchor": "end", "class": "tick" }, root).textContent = fmt(t[0]);
    });
    [[x0, L, "start"], [x1, W - R, "end"]].forEach(function (t) {
      svg("text", { x: t[1], y: H - 8, "text-anchor": t[2], "class": "tick" }, root).textContent = "step " + t[0];
    });
    var line = points.map(function (p) { return px(p[0]).toFixed(1) + "," + py(p[1]).toFixed(1); }).join(" ");
    svg("polyline", { points: line, "class": "curve" }, root);
    points.forEach(function (p) {
      var parent = root;
      if (p[0] >= 1) parent = svg("a", { href: "/trajectories?step=" + p[0], "class": "point-link" }, root);
      var dot = svg("circle", { cx: px(p[0]).toFixed(1), cy: py(p[1]).toFixed(1), r: 3.5, "class": "point" }, parent);
      svg("title", {}, dot).textContent = "step " + p[0] + ": " + fmt(p[1]) + (p[0] >= 1 ? " (open its trajectories)" : "");
    });
    return fig;
  }

  function drawCharts(series) {
    var box = document.getElementById("charts");
    var select = document.getElementById("add-metric");
    box.textContent = "";
    var names = Object.keys(series).sort();
    if (names.length === 0) {
      var p = document.createElement("p");
      p.className = "hint";
      p.textContent = "No metrics yet.";
      box.appendChild(p);
    }
    var shown = [];
    PREFERRED.forEach(function (re) {
      names.forEach(function (n) { if (re.test(n) && shown.indexOf(n) < 0) shown.push(n); });
    });
    shown.forEach(function (n) { box.appendChild(chart(n, series[n])); });
    while (select.options.length > 1) select.remove(1);
    names.filter(function (n) { return shown.indexOf(n) < 0; }).forEach(function (n) {
      var o = document.createElement("option");
      o.value = n;
      o.textContent = n;
      select.appendChild(o);
    });
    select.onchange = function () {
      if (select.value && series[select.value]) box.appendChild(chart(select.value, series[select.value]));
      select.value = "";
    };
  }

  function getJson(url) {
    return fetch(url, { cache: "no-store" }).then(function (r) {
      if (!r.ok) throw new Error(url + ": HTTP " + r.status);
      return r.json();
    });
  }

  function colourTokens(mode) {
    var traj = document.querySelector(".traj");
    if (!traj) return;
    traj.dataset.color = mode;
    var steps = Array.prototype.slice.call(document.querySelectorAll(".step"));
    var scale = steps.reduce(function (m, s) { return Math.max(m, Math.abs(parseFloat(s.dataset.advantage) || 0)); }, 0) || 1;
    steps.forEach(function (s) {
      var adv = parseFloat(s.dataset.advantage) || 0;
      s.querySelectorAll(".tok").forEach(function (t) {
        if (mode === "advantage") {
          var a = Math.min(1, Math.abs(adv) / scale) * 0.55;
          t.style.backgroundColor = adv >= 0 ? "rgba(40,160,70," + a + ")" : "rgba(210,50,50," + a + ")";
        } else {
          var p = Math.exp(Math.min(0, parseFloat(t.dataset.lp) || 0));
          t.style.backgroundColor = "rgba(230,120,20," + ((1 - p) * 0.7).toFixed(3) + ")";
        }
      });
    });
    ["logprob", "advantage"].forEach(function (m) {
      var b = document.getElementById("color-" + m);
      if (b) b.classList.toggle("on", m === mode);
    });
  }

  function initTrajectory() {
    var traj = document.querySelector(".traj");
    colourTokens(traj.dataset.color);
    ["logprob", "advantage"].forEach(function (m) {
      document.getElementById("color-" + m).addEventListener("click", function () {
        colourTokens(m);
        var url = new URL(window.location.href);
        url.searchParams.set("color", m);
        window.history.replaceState(null, "", url.toString());
      });
    });
  }

  // Polls /api/status: a live page reloads when the dataset grew, others say so.
  function watch() {
    var known = body.dataset.generation;
    setInterval(function () {
      getJson("/api/status").then(function (s) {
        if (String(s.generation) === known) return;
        if (body.dataset.live === "1") { window.location.reload(); return; }
        var live = document.getElementById("live");
        live.textContent = "";
        var a = document.createElement("a");
        a.href = window.location.href;
        a.textContent = "new steps: " + s.records + " records now, reload";
        live.appendChild(a);
      }).catch(function () {
        document.getElementById("live").textContent = "viewer unreachable";
      });
    }, 2000);
  }

  function ready() { body.dataset.ready = "1"; }

  try {
    var kind = body.dataset.page;
    if (kind !== "error") watch();
    if (kind === "trajectory") initTrajectory();
    if (kind === "run" && document.getElementById("charts")) {
      getJson("/api/metrics").then(function (m) {
        if (m.error) throw new Error(m.error);
        drawCharts(m.series);
        ready();
      }).catch(function (e) { report(e.message); });
    } else {
      ready();
    }
  } catch (e) {
    report(e.message);
  }
})();
