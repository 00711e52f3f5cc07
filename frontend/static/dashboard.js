// Pantheon's dashboard: reads /admin/dashboard every 2 s with the admin key from this
// tab's sessionStorage (never a cookie, never the URL); admin actions send it in a header.
"use strict";

const KEY = "pantheon.adminKey", API_KEY = "pantheon.apiKey", EVERY_MS = 2000;
const $ = (id) => document.getElementById(id);
let timer = null, readonly = true, lastModels = [];

function headers(api) {
  const key = api ? (sessionStorage.getItem(API_KEY) || sessionStorage.getItem(KEY))
                  : sessionStorage.getItem(KEY);
  const h = {"Content-Type": "application/json"};
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c ?? ""));
  return node;
}

function bytes(n) {
  if (!n) return "0";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }

function spark(points, field) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", "0 0 90 22");
  const values = points.map((p) => p[field] ?? 0);
  const top = Math.max(...values, 1e-9);
  const step = 90 / Math.max(values.length - 1, 1);
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", values.map((v, i) =>
    (i * step).toFixed(1) + "," + (21 - (v / top) * 20).toFixed(1)).join(" "));
  svg.append(line);
  const title = document.createElementNS(ns, "title");
  title.textContent = field + " over the last 10 minutes, peak " + top.toFixed(2);
  svg.append(title);
  return svg;
}

function memoryBar(d) {
  const budget = d.budget_bytes || 1;
  const bar = el("div", {class: "bar", title: `weights ${bytes(d.weight_bytes)}, KV ` +
    `${bytes(d.kv_bytes)}, free ${bytes(d.free_bytes)} of ${bytes(d.budget_bytes)}`});
  bar.append(el("div", {class: "weights"}), el("div", {class: "kv"}));
  bar.children[0].style.width = (100 * d.weight_bytes / budget).toFixed(2) + "%";
  bar.children[1].style.width = (100 * d.kv_bytes / budget).toFixed(2) + "%";
  return el("div", {}, bar, el("span", {class: "muted"},
    `${bytes(d.used_bytes)} / ${bytes(d.budget_bytes)}`));
}

function renderDies(dies) {
  const body = $("dies").tBodies[0];
  body.replaceChildren(...dies.map((d) => el("tr", {"data-die": d.die},
    el("td", {}, d.die),
    el("td", {}, d.device && d.device !== d.kind ? `${d.kind}: ${d.device}` : d.kind),
    el("td", {}, el("span", {class: "state-" + d.state}, d.state),
       el("div", {class: "muted"}, `beat ${d.heartbeat_age_s ?? "–"} s ago, ` +
         `${d.restarts} restart${d.restarts === 1 ? "" : "s"}`)),
    el("td", {}, memoryBar(d)),
    el("td", {class: "num"}, `${d.busy} / ${d.slots}`),
    el("td", {}, d.models.join(", ") || "–"))));
  const pick = $("load-die"), chosen = pick.value;
  pick.replaceChildren(el("option", {value: ""}, "auto"),
    ...dies.map((d) => el("option", {value: d.die}, d.die)));
  pick.value = chosen;
}

function button(label, action) {
  const b = el("button", {type: "button", className: "admin-only"}, label);
  b.disabled = readonly;
  b.addEventListener("click", action);
  return b;
}

function renderModels(models, available) {
  const body = $("models").tBodies[0];
  const rows = models.map((m) => {
    const replicas = el("td", {});
    for (const r of m.replicas) {
      const line = el("div", {}, `${r.die ?? "?"}: `, el("span", {class: "state-" + r.state}, r.state),
                      ` ${r.in_flight} running, ${r.slots}×${r.ctx}`);
      if (r.state === "loading" && r.progress.total) {
        const bar = el("div", {class: "progress"}, el("div", {}));
        bar.firstChild.style.width = (100 * r.progress.done / r.progress.total).toFixed(1) + "%";
        line.append(bar);
      }
      replicas.append(line);
    }
    return el("tr", {"data-model": m.name},
      el("td", {}, el("strong", {}, m.name), el("div", {class: "state-" + m.status}, m.status)),
      replicas,
      el("td", {class: "num"}, `${m.busy} / ${m.slots}`),
      el("td", {class: "num"}, String(m.queued)),
      el("td", {class: "num"}, m.cached_ratio == null ? "–" : (100 * m.cached_ratio).toFixed(0) + " %"),
      el("td", {class: "num tokens"}, String(m.generated_tokens)),
      el("td", {class: "num"}, spark(m.history, "tokens_per_s"), " " + m.tokens_per_s_1m),
      el("td", {class: "num"}, spark(m.history, "ttft_p50_s"),
         " " + (m.ttft_p50_s_1m == null ? "–" : m.ttft_p50_s_1m.toFixed(3) + " s")),
      el("td", {}, button("Unload", () => admin("unload", {name: m.name,
        timeout_s: Number($("drain-timeout").value || 0)}))));
  });
  for (const a of available) {
    rows.push(el("tr", {"data-model": a.name},
      el("td", {}, el("strong", {}, a.name), el("div", {class: "muted"}, "available")),
      el("td", {colSpan: 7, class: "muted"}, a.path),
      el("td", {}, button("Load", () => admin("load", {path: a.path, name: a.name})))));
  }
  body.replaceChildren(...rows);
  const names = models.filter((m) => m.status === "loaded").map((m) => m.name);
  if (names.join() !== lastModels.join()) {
    const pick = $("try-model"), chosen = pick.value;
    pick.replaceChildren(...names.map((n) => el("option", {value: n}, n)));
    if (names.includes(chosen)) pick.value = chosen;
    lastModels = names;
  }
}

function renderLog(errors, actions) {
  $("errors").tBodies[0].replaceChildren(...errors.map((e) => el("tr", {},
    el("td", {}, clock(e.time)), el("td", {}, String(e.status)), el("td", {}, e.code || "–"),
    el("td", {}, e.model || "–"), el("td", {}, e.route))));
  $("actions").tBodies[0].replaceChildren(...actions.map((a) => el("tr", {},
    el("td", {}, clock(a.time)), el("td", {}, a.action),
    el("td", {}, [a.name, a.id, a.die].filter(Boolean).join(" ") || a.path || "–"),
    el("td", {class: a.status >= 400 ? "error" : ""}, String(a.status) +
       (a.error ? ": " + a.error : "")))));
}

function showLogin(message) {
  clearTimeout(timer);
  $("board").hidden = true;
  $("logout").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("status").textContent = "signed out";
}

async function refresh() {
  clearTimeout(timer);
  let reply;
  try {
    reply = await fetch("/admin/dashboard", {headers: headers(false), cache: "no-store"});
  } catch (err) {
    $("status").textContent = "server not answering: " + err.message;
    timer = setTimeout(refresh, EVERY_MS);
    return;
  }
  if (reply.status === 401) {
    const had = sessionStorage.getItem(KEY);
    sessionStorage.removeItem(KEY);
    showLogin(had ? "That key was refused (401)." : "");
    return;
  }
  if (!reply.ok) {
    $("status").textContent = `the server answered ${reply.status}`;
    timer = setTimeout(refresh, EVERY_MS);
    return;
  }
  const data = await reply.json();
  readonly = data.readonly;
  document.body.classList.toggle("readonly", readonly);
  $("login").hidden = true;
  $("board").hidden = false;
  $("logout").hidden = !sessionStorage.getItem(KEY);
  $("status").textContent = (data.draining ? "draining · " : "") +
    `up ${Math.round(data.uptime_s)} s · updated ${clock(data.time)}` +
    (readonly ? " · read-only" : "");
  renderDies(data.dies);
  renderModels(data.models, data.available);
  renderLog(data.errors, data.actions);
  timer = setTimeout(refresh, EVERY_MS);
}

async function admin(action, body) {
  if (readonly) return;
  const out = $("action-result");
  out.className = "";
  out.textContent = `${action} ${body.name || body.path} …`;
  try {
    const reply = await fetch("/admin/models/" + action, {method: "POST",
      headers: headers(false), body: JSON.stringify(body)});
    const answer = await reply.json();
    out.className = reply.ok ? "" : "error";
    out.textContent = reply.ok ? `${action} ${body.name || body.path}: done`
      : `${action} failed (${reply.status}): ${answer.error?.message ?? ""}`;
  } catch (err) {
    out.className = "error";
    out.textContent = `${action} failed: ${err.message}`;
  }
  refresh();
}

async function tryIt(event) {
  event.preventDefault();
  const out = $("try-reply");
  out.textContent = "";
  const reply = await fetch("/v1/chat/completions", {method: "POST", headers: headers(true),
    body: JSON.stringify({model: $("try-model").value, stream: true, max_tokens: 128,
      messages: [{role: "user", content: $("try-prompt").value}]})});
  if (!reply.ok) {
    const answer = await reply.json().catch(() => ({}));
    out.textContent = `error ${reply.status}: ${answer.error?.message ?? ""}`;
    return;
  }
  const reader = reply.body.getReader(), decoder = new TextDecoder();
  let pending = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    pending += decoder.decode(value, {stream: true});
    const events = pending.split("\n\n");
    pending = events.pop();
    for (const e of events) {
      const data = e.replace(/^data: /, "");
      if (data === "[DONE]") return;
      try {
        const chunk = JSON.parse(data);
        if (chunk.error) { out.textContent += `\n[error: ${chunk.error.message}]`; return; }
        out.textContent += chunk.choices?.[0]?.delta?.content ?? "";
      } catch (_) { /* a comment or keep-alive line */ }
    }
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, $("key").value);
    if ($("api-key").value) sessionStorage.setItem(API_KEY, $("api-key").value);
    $("key").value = $("api-key").value = "";
    refresh();
  });
  $("logout").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    sessionStorage.removeItem(API_KEY);
    showLogin("");
  });
  $("load-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const body = {path: $("load-path").value};
    if ($("load-name").value) body.name = $("load-name").value;
    if ($("load-die").value) body.dies = [$("load-die").value];
    admin("load", body);
  });
  $("try-form").addEventListener("submit", tryIt);
  refresh();
});
