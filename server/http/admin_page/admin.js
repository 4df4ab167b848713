/* The admin page of inference-server, served at /admin (server/http/admin.py, AdminPage): projects,
 * their keys, rate limits, model permissions and spend limit, usage over time (of the generation or the embedding
 * models), every model's engine now (docs/operations.md,
 * "Admin page"). Every figure comes from the Admin API (/v1/organization/..., server/http/admin.py),
 * called with the admin key as a bearer token; the key is kept in this tab's sessionStorage only,
 * never in a URL, a cookie or a log.
 *
 * The chart is Chart.js v4.6.2 (MIT License, Copyright (c) 2014-2024 Chart.js Contributors,
 * https://www.chartjs.org): chart.umd.js beside this file, package/dist/chart.umd.js of the npm
 * package chart.js@4.6.2, unchanged, license header included.
 *
 * Rules kept here: no data is inserted as HTML (textContent only); a new key's value is shown
 * once, in #secret-value, and removed from the page when dismissed, on a change of project and
 * on logout; the Content-Security-Policy (default-src 'self') allows no inline script, so every
 * handler is attached below.
 *
 * For tests: window.adminPageUsage holds what the chart shows (labels, datasets, totals) and
 * `updated`, a count of the usage refreshes.
 */
(function () {
  "use strict";

  const ORG = "/v1/organization";
  const KEY_STORE = "inference-server.admin-key";
  const REFRESH_MS = 5000;
  const PAGE_SIZE = 20;
  const WIDTH_S = {"1m": 60, "1h": 3600, "1d": 86400};
  const WIDTH_N = {"1m": 60, "1h": 24, "1d": 31};  // buckets shown: the last hour, day, month
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                  "#bcbd22", "#17becf"];

  const $ = (id) => document.getElementById(id);
  const state = {
    project: null,        // the selected project (its Admin API object)
    names: {},            // project id -> name, of every project seen
    pendingNames: {},     // project ids being looked up
    cursors: [null],      // the `after` of each page of projects visited
    page: 0,
    rateLimitId: null,
    chart: null,
    timer: null,
    busy: {usage: false, engine: false, spend: false},
    again: {},
    updates: 0,
  };

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // ---- the Admin API ----
  function adminKey() {
    return sessionStorage.getItem(KEY_STORE);
  }

  // Every admin request reads the server's latest state first (server/control/admin.py,
  // Admin.sync): a read after a change sees it, whichever worker or replica answers.
  const api = (method, path, body) => call(method, path, body);

  /** Run the reads ``fns`` after a change. */
  async function reread(...fns) {
    await Promise.all(fns.map((fn) => fn()));
  }

  async function call(method, path, body) {
    const key = adminKey();
    if (!key) throw new ApiError(401, "Log in with an admin key.");
    const init = {method, headers: {Authorization: "Bearer " + key}, cache: "no-store", credentials: "omit"};
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let resp;
    try {
      resp = await fetch(path, init);
    } catch (e) {
      throw new ApiError(0, "The server cannot be reached.");
    }
    let data = null;
    try {
      data = await resp.json();
    } catch (e) {
      data = null;
    }
    if (!resp.ok) {
      const error = data && data.error;
      const message = error && typeof error.message === "string" ? error.message : "HTTP " + resp.status;
      throw new ApiError(resp.status, message);
    }
    return data;
  }

  const enc = encodeURIComponent;
  const projectPath = (suffix) => ORG + "/projects/" + enc(state.project.id) + (suffix || "");

  // ---- messages ----
  function showMessage(text, kind) {
    const m = $("message");
    m.textContent = text;
    m.className = "message " + (kind || "error");
    m.hidden = false;
  }

  function clearMessage() {
    const m = $("message");
    m.textContent = "";
    m.hidden = true;
  }

  /** An API call failed: a refused key returns to the login form; anything else is shown. */
  function failed(err) {
    if (err instanceof ApiError && (err.status === 401 || err.status === 403)) {
      logout("The admin key was refused (HTTP " + err.status + "): " + err.message);
    } else {
      showMessage(err instanceof ApiError ? err.message : "Unexpected error: " + err);
    }
  }

  /** Run ``fn`` as a user's action: the banner is cleared first, a failure shown. */
  function action(fn) {
    return async function (ev) {
      if (ev && ev.preventDefault) ev.preventDefault();
      clearMessage();
      try {
        await fn(ev);
      } catch (e) {
        failed(e);
      }
    };
  }

  // ---- small DOM helpers (text only) ----
  function el(tag, text, attrs) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
    return node;
  }

  function button(label, testid, onClick) {
    const b = el("button", label, {type: "button", "data-testid": testid});
    b.addEventListener("click", action(onClick));
    return b;
  }

  /** A button that asks to be clicked again (within 5 s) before it acts. */
  function confirmButton(label, confirmLabel, testid, onConfirm) {
    const b = el("button", label, {type: "button", "data-testid": testid});
    let armed = null;
    const disarm = () => {
      clearTimeout(armed);
      armed = null;
      b.textContent = label;
      b.classList.remove("armed");
    };
    b.addEventListener("click", action(async () => {
      if (!armed) {
        b.textContent = confirmLabel;
        b.classList.add("armed");
        armed = setTimeout(disarm, 5000);
        return;
      }
      disarm();
      b.disabled = true;
      try {
        await onConfirm();
      } finally {
        b.disabled = false;
      }
    }));
    return b;
  }

  function row(cells, attrs) {
    const tr = el("tr", null, attrs);
    for (const cell of cells) {
      const td = el("td");
      if (cell instanceof Node) td.append(cell);
      else if (Array.isArray(cell)) td.append(...cell);
      else td.textContent = cell === null || cell === undefined ? "" : String(cell);
      tr.append(td);
    }
    return tr;
  }

  function emptyRow(tbody, columns, text) {
    const td = el("td", text, {colspan: String(columns), class: "empty"});
    const tr = el("tr");
    tr.append(td);
    tbody.append(tr);
  }

  const fmtNumber = (n) => (typeof n === "number" ? n.toLocaleString("en-US") : "–");
  function fmtTime(s) {
    if (!s) return "–";
    return new Date(s * 1000).toISOString().slice(0, 16).replace("T", " ") + " UTC";
  }
  function fmtBucket(s, width) {
    const iso = new Date(s * 1000).toISOString();
    if (width === "1d") return iso.slice(0, 10);
    if (width === "1h") return iso.slice(5, 10) + " " + iso.slice(11, 16);
    return iso.slice(11, 16);
  }
  function fmtCents(cents) {  // cents (fractions of a cent included) as US dollars
    return "$" + (cents / 100).toLocaleString("en-US", {minimumFractionDigits: 2, maximumFractionDigits: 6});
  }

  // ---- login and logout ----
  async function enter() {
    clearMessage();
    try {
      await api("GET", ORG + "/projects?limit=1");
    } catch (e) {
      if (e instanceof ApiError && e.status === 404) logout(e.message);  // the Admin API is off
      else failed(e);
      return;
    }
    $("login").hidden = true;
    $("app").hidden = false;
    $("logout").hidden = false;
    state.cursors = [null];
    state.page = 0;
    if (state.timer === null) state.timer = setInterval(tick, REFRESH_MS);
    await Promise.all([loadProjects().catch(failed), tick()]);
  }

  function logout(message) {
    sessionStorage.removeItem(KEY_STORE);
    if (state.timer !== null) clearInterval(state.timer);
    state.timer = null;
    clearSecret();
    closeProject();
    state.names = {};
    for (const id of ["projects-table", "keys-table", "usage-totals"]) $(id).tBodies[0].replaceChildren();
    if (state.chart) {
      state.chart.destroy();
      state.chart = null;
    }
    window.adminPageUsage = undefined;
    $("app").hidden = true;
    $("logout").hidden = true;
    $("login").hidden = false;
    if (message) showMessage(message);
    else clearMessage();
    $("admin-key").focus();
  }

  $("login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const input = $("admin-key");
    const key = input.value.trim();
    input.value = "";
    if (!key) return;
    sessionStorage.setItem(KEY_STORE, key);
    enter();
  });
  $("logout").addEventListener("click", () => logout());

  // ---- the refresh ----
  async function tick() {
    if (!adminKey() || document.visibilityState === "hidden") return;
    await Promise.all([loadUsage(), loadEngine(), state.project ? loadSpend() : null].map((p) =>
      Promise.resolve(p).catch(failed)));
  }

  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "visible" && state.timer !== null) tick();
  });

  async function once(name, fn) {  // one request of a kind at a time; one asked meanwhile runs after
    if (state.busy[name]) {
      state.again[name] = fn;
      return;
    }
    state.busy[name] = true;
    try {
      await fn();
    } finally {
      state.busy[name] = false;
      const next = state.again[name];
      delete state.again[name];
      if (next) await once(name, next);
    }
  }

  // ---- the engine ----
  function loadEngine() {
    return once("engine", async () => {
      const e = await api("GET", ORG + "/engine");
      const tbody = $("engines-table").tBodies[0];
      tbody.replaceChildren();
      for (const m of e.models) {  // the default model's first
        const embeds = m.kind === "embed";  // no KV cells kept between steps, no prefix cache
        const ready = el("span", m.ready ? "yes" : "no (starting or restarting)", {class: m.ready ? "ok" : "bad"});
        const tr = row([m.model, embeds ? "embeddings" : "generation", ready,
                        fmtNumber(m.slots_in_use) + " of " + fmtNumber(m.slots), fmtNumber(m.queued),
                        embeds ? "–" : fmtNumber(m.kv_cells) + " of " + fmtNumber(m.kv_cells_budget),
                        embeds ? "–" : fmtNumber(m.prefix_cache_entries) + " entries, " +
                          fmtNumber(m.prefix_cache_tokens) + " tokens",
                        embeds ? "–" : fmtNumber(m.preemptions)],
                       {"data-testid": "engine-row", "data-model": m.model});
        ["engine-model", "engine-kind", "engine-ready", "engine-slots", "engine-queued", "engine-kv", "engine-cache",
         "engine-preemptions"].forEach((id, i) => tr.cells[i].setAttribute("data-testid", id));
        tbody.append(tr);
      }
    });
  }

  // ---- projects ----
  async function loadProjects() {
    const after = state.cursors[state.page];
    let query = "?include_archived=true&limit=" + PAGE_SIZE;
    if (after) query += "&after=" + enc(after);
    const page = await api("GET", ORG + "/projects" + query);
    const tbody = $("projects-table").tBodies[0];
    tbody.replaceChildren();
    for (const p of page.data) {
      state.names[p.id] = p.name;
      const buttons = [button("Open", "project-open", () => openProject(p))];
      if (p.status !== "archived" && p.source !== "file") {
        buttons.push(confirmButton("Archive", "Archive: sure?", "project-archive", () => archiveProject(p)));
      }
      tbody.append(row([p.name, el("code", p.id), p.status, p.priority, p.weight, p.source, fmtTime(p.created_at),
                        buttons], {"data-project-id": p.id, class: state.project && state.project.id === p.id ?
                                                                          "selected" : ""}));
    }
    if (!page.data.length) emptyRow(tbody, 8, "No projects yet.");
    state.cursors[state.page + 1] = page.has_more ? page.last_id : undefined;
    $("projects-prev").disabled = state.page === 0;
    $("projects-next").disabled = !page.has_more;
  }

  $("projects-prev").addEventListener("click", action(async () => {
    state.page = Math.max(0, state.page - 1);
    await loadProjects();
  }));
  $("projects-next").addEventListener("click", action(async () => {
    if (state.cursors[state.page + 1]) state.page += 1;
    await loadProjects();
  }));

  $("project-form").addEventListener("submit", action(async () => {
    const body = {name: $("project-name").value};
    if ($("project-priority").value) body.priority = $("project-priority").value;
    if ($("project-weight").value !== "") body.weight = Number($("project-weight").value);
    const project = await api("POST", ORG + "/projects", body);
    $("project-form").reset();
    state.names[project.id] = project.name;
    showMessage("Project " + project.name + " created.", "info");
    await openProject(project);
    await reread(loadProjects);
  }));

  async function archiveProject(p) {
    const project = await api("POST", ORG + "/projects/" + enc(p.id) + "/archive");
    showMessage("Project " + project.name + " archived: its keys no longer work.", "info");
    if (state.project && state.project.id === project.id) await openProject(project);
    await reread(loadProjects);
  }

  // ---- one project ----
  function closeProject() {
    state.project = null;
    state.rateLimitId = null;
    $("project-panel").hidden = true;
    $("keys-table").tBodies[0].replaceChildren();
  }

  async function openProject(p) {
    if (!state.project || state.project.id !== p.id) clearSecret();
    state.project = p;
    for (const tr of $("projects-table").tBodies[0].rows) {
      tr.classList.toggle("selected", tr.getAttribute("data-project-id") === p.id);
    }
    $("project-title").textContent = p.name + " (" + p.id + ")";
    const fromFile = p.source === "file", archived = p.status === "archived";
    const note = $("project-note");
    note.textContent = fromFile ? "Defined by the tenant file: change its keys and limits there (a spend limit " +
      "can be set here)." : archived ? "Archived: its keys no longer work; its usage and spend stay readable." : "";
    note.hidden = !(fromFile || archived);
    for (const id of ["key-name", "key-create", "rotate-grace"]) $(id).disabled = fromFile || archived;
    for (const id of ["rate-rpm", "rate-tpm", "rate-rpd", "rate-save"]) $(id).disabled = fromFile || archived;
    for (const id of ["models-mode", "models-ids", "models-save"]) $(id).disabled = fromFile || archived;
    $("project-panel").hidden = false;
    await Promise.all([loadKeys(), loadRateLimits(), loadModels(), loadSpend()].map((p) => p.catch(failed)));
  }

  // keys
  async function loadKeys() {
    const project = state.project;
    if (!project) return;
    const keys = [];
    let after = null;
    for (let i = 0; i < 10; i++) {  // at most 100 keys a project (server/control/admin.py)
      const page = await api("GET", projectPath("/api_keys?limit=100" + (after ? "&after=" + enc(after) : "")));
      keys.push(...page.data);
      if (!page.has_more) break;
      after = page.last_id;
    }
    if (state.project !== project) return;
    const tbody = $("keys-table").tBodies[0];
    tbody.replaceChildren();
    const writable = project.source !== "file" && project.status !== "archived";
    for (const k of keys) {
      const buttons = writable ? [
        confirmButton("Rotate", "Rotate: sure?", "key-rotate", () => rotateKey(k)),
        confirmButton("Revoke", "Revoke: sure?", "key-revoke", () => revokeKey(k)),
      ] : [];
      tbody.append(row([k.name, el("code", k.redacted_value), el("code", k.id), k.owner_project_access,
                        fmtTime(k.created_at), k.expires_at ? fmtTime(k.expires_at) : "never", buttons],
                       {"data-key-id": k.id}));
    }
    if (!keys.length) emptyRow(tbody, 7, "No keys.");
  }

  $("key-form").addEventListener("submit", action(async () => {
    const name = $("key-name").value;
    const account = await api("POST", projectPath("/service_accounts"), {name});
    $("key-name").value = "";
    if (account.api_key) showSecret(account.api_key.value, "New key " + account.api_key.name);
    await reread(loadKeys);
  }));

  async function rotateKey(k) {
    const grace = Math.max(0, Math.floor(Number($("rotate-grace").value) || 0));
    const key = await api("POST", projectPath("/api_keys/" + enc(k.id) + "/rotate"), {grace_period_seconds: grace});
    showSecret(key.value, "New key " + key.name + " (the old one works " +
      (grace ? "for " + grace + " s more" : "no more") + ")");
    await reread(loadKeys);
  }

  async function revokeKey(k) {
    await api("DELETE", projectPath("/api_keys/" + enc(k.id)));
    showMessage("Key " + k.redacted_value + " revoked.", "info");
    await reread(loadKeys);
  }

  // the key shown once
  function showSecret(value, label) {
    $("secret-label").textContent = label;
    $("secret-value").textContent = value;
    $("secret-copied").textContent = "";
    $("secret").hidden = false;
  }

  function clearSecret() {
    $("secret-value").textContent = "";
    $("secret-copied").textContent = "";
    $("secret").hidden = true;
  }

  $("secret-dismiss").addEventListener("click", clearSecret);
  $("secret-copy").addEventListener("click", async () => {
    const value = $("secret-value").textContent;
    try {
      await navigator.clipboard.writeText(value);
      $("secret-copied").textContent = "Copied.";
    } catch (e) {  // no clipboard API (a page not on https or localhost): select it for Ctrl+C
      const range = document.createRange();
      range.selectNodeContents($("secret-value"));
      const selection = window.getSelection();
      selection.removeAllRanges();
      selection.addRange(range);
      $("secret-copied").textContent = "Selected: press Ctrl+C (⌘C) to copy.";
    }
  });

  // rate limits
  function showRateLimit(rl) {
    state.rateLimitId = rl.id;
    $("rate-model").textContent = "model " + rl.model + ":";
    $("rate-rpm").value = rl.max_requests_per_1_minute;
    $("rate-tpm").value = rl.max_tokens_per_1_minute;
    $("rate-rpd").value = rl.max_requests_per_1_day;
  }

  async function loadRateLimits() {
    const project = state.project;
    if (!project) return;
    const page = await api("GET", projectPath("/rate_limits"));
    if (state.project === project && page.data.length) showRateLimit(page.data[0]);
  }

  $("rate-form").addEventListener("submit", action(async () => {
    if (!state.rateLimitId) return;
    const int = (id) => Math.max(0, Math.floor(Number($(id).value) || 0));
    const rl = await api("POST", projectPath("/rate_limits/" + enc(state.rateLimitId)), {
      max_requests_per_1_minute: int("rate-rpm"), max_tokens_per_1_minute: int("rate-tpm"),
      max_requests_per_1_day: int("rate-rpd")});
    showRateLimit(rl);
    showMessage("Rate limits saved.", "info");
  }));

  // model permissions: "every model" is OpenAI's empty deny list, and a DELETE
  function showModels(m) {
    const every = m.mode === "deny_list" && !m.model_ids.length;
    $("models-mode").value = every ? "" : m.mode;
    $("models-ids").value = m.model_ids.join(", ");
  }

  async function loadModels() {
    const project = state.project;
    if (!project) return;
    const m = await api("GET", projectPath("/model_permissions"));
    if (state.project === project) showModels(m);
  }

  $("models-form").addEventListener("submit", action(async () => {
    const mode = $("models-mode").value;
    const ids = $("models-ids").value.split(",").map((s) => s.trim()).filter((s) => s);
    if (mode) {
      showModels(await api("POST", projectPath("/model_permissions"), {mode, model_ids: ids}));
    } else {
      await api("DELETE", projectPath("/model_permissions"));
      showModels({mode: "deny_list", model_ids: []});
    }
    showMessage("Model permissions saved.", "info");
  }));

  // spend
  function showSpend(s) {
    $("spend-spent").textContent = fmtCents(s.spent_amount);
    $("spend-reserved").textContent = fmtCents(s.reserved_amount);
    $("spend-limit").textContent = s.threshold_amount ? fmtCents(s.threshold_amount) : "none";
    $("spend-tokens").textContent = fmtNumber(s.tokens_used);
    $("spend-status").textContent = s.enforcement && s.enforcement.status;
    $("spend-prices").hidden = !!s.prices_set;
    const used = s.threshold_amount ? (s.spent_amount + s.reserved_amount) / s.threshold_amount : 0;
    $("spend-bar").style.width = Math.min(100, used * 100).toFixed(1) + "%";
    $("spend-bar").className = used >= 1 ? "over" : used >= 0.8 ? "near" : "";
    $("spend-remove").disabled = !s.threshold_amount;
  }

  function loadSpend() {
    return once("spend", async () => {
      const project = state.project;
      if (!project) return;
      const s = await api("GET", projectPath("/spend_limit"));
      if (state.project === project) showSpend(s);
    });
  }

  $("spend-form").addEventListener("submit", action(async () => {
    const cents = Math.round(Number($("spend-amount").value) * 100);
    if (!(cents >= 1)) throw new ApiError(400, "The limit must be at least $0.01.");
    showSpend(await api("POST", projectPath("/spend_limit"), {threshold_amount: cents, currency: "USD",
                                                               interval: "month"}));
    $("spend-amount").value = "";
    showMessage("Spend limit set.", "info");
  }));

  $("spend-remove").addEventListener("click", action(async () => {
    await api("DELETE", projectPath("/spend_limit"));
    await reread(loadSpend);
    showMessage("Spend limit removed.", "info");
  }));

  // ---- usage ----
  function projectLabel(id) {
    if (id === null || id === undefined) return "(no project)";
    if (state.names[id] !== undefined) return state.names[id] + " (" + id + ")";
    if (!state.pendingNames[id]) {  // a project on another page: its name for the next refresh
      state.pendingNames[id] = true;
      api("GET", ORG + "/projects/" + enc(id)).then((p) => {
        state.names[id] = p.name;
      }, () => {}).finally(() => {
        delete state.pendingNames[id];
      });
    }
    return id;
  }

  function loadUsage() {
    return once("usage", async () => {
      const usageApi = $("usage-api").value, width = $("usage-width").value, group = $("usage-group").value;
      const start = Math.floor(Date.now() / 1000) - (WIDTH_N[width] - 1) * WIDTH_S[width];
      const query = "?start_time=" + start + "&bucket_width=" + width + "&group_by=" + group +
        "&limit=" + WIDTH_N[width];
      const buckets = [];
      let cursor = null;
      for (let i = 0; i < 4; i++) {  // a clock ahead of the server's can make a second page
        const page = await api("GET", ORG + "/usage/" + usageApi + query + (cursor ? "&page=" + enc(cursor) : ""));
        buckets.push(...page.data);
        if (!page.has_more || !page.next_page) break;
        cursor = page.next_page;
      }
      if (usageApi === $("usage-api").value && width === $("usage-width").value && group === $("usage-group").value) {
        showUsage(buckets, usageApi, width, group);
      }
    });
  }

  function showUsage(buckets, usageApi, width, group) {
    const labels = buckets.map((b) => fmtBucket(b.start_time, width));
    const groups = new Map();
    buckets.forEach((bucket, i) => {
      for (const r of bucket.results) {
        const key = r[group] === undefined ? null : r[group];
        if (!groups.has(key)) {
          groups.set(key, {key, label: group === "project_id" ? projectLabel(key) : String(key),
                           data: new Array(buckets.length).fill(0), input: 0, output: 0, requests: 0});
        }
        const g = groups.get(key), output = r.output_tokens || 0;  // embeddings: input only
        g.data[i] += r.input_tokens + output;
        g.input += r.input_tokens;
        g.output += output;
        g.requests += r.num_model_requests;
      }
    });
    const all = [...groups.values()].sort((a, b) => String(a.label).localeCompare(String(b.label)));

    const tbody = $("usage-totals").tBodies[0];
    tbody.replaceChildren();
    for (const g of all) {
      tbody.append(row([g.label, fmtNumber(g.input), fmtNumber(g.output), fmtNumber(g.requests)],
                       {"data-testid": "usage-row", "data-group": g.key === null ? "" : String(g.key)}));
    }
    if (!all.length) emptyRow(tbody, 4, "No usage in this window.");

    const datasets = all.map((g, i) => ({label: g.label, data: g.data, stack: "tokens",
                                         backgroundColor: COLORS[i % COLORS.length],
                                         borderColor: COLORS[i % COLORS.length]}));
    state.updates += 1;
    window.adminPageUsage = {
      api: usageApi, width, group, labels, updated: state.updates,
      datasets: all.map((g) => ({key: g.key, label: g.label, data: g.data.slice()})),
      totals: all.map((g) => ({key: g.key, label: g.label, input_tokens: g.input, output_tokens: g.output,
                               requests: g.requests})),
    };
    if (typeof window.Chart !== "function") return;  // the table still shows the figures
    if (state.chart === null) {
      state.chart = new window.Chart($("usage-chart"), {
        type: "bar",
        data: {labels, datasets},
        options: {
          animation: false, responsive: true, maintainAspectRatio: false,
          scales: {x: {stacked: true}, y: {stacked: true, beginAtZero: true, title: {display: true, text: "tokens"}}},
          plugins: {legend: {position: "bottom"}},
        },
      });
    } else {
      state.chart.data.labels = labels;
      state.chart.data.datasets = datasets;
      state.chart.update("none");
    }
  }

  $("usage-form").addEventListener("submit", action(() => loadUsage()));
  for (const id of ["usage-api", "usage-width", "usage-group"]) $(id).addEventListener("change", action(() => loadUsage()));

  // ---- start ----
  if (adminKey()) enter();
  else $("admin-key").focus();
})();
