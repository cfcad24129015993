// The graft trajectory browser: one page, four views, every number read from the store's REST API.
// The URL holds the whole state (path and query), so any view can be shared as a link. No build step, no
// library: DOM nodes are built with h() (never innerHTML: problem and completion texts are untrusted).

const AUTO_REFRESH_MS = 5000;
const GROUPS_SHOWN = 4; // groups per model on a prompt page before "show more"
const PROMPTS_PER_PAGE = 50;
const LOGPROB_FULL_COLOUR = Math.log(1000); // p <= 0.001 gets the full colour
const LOW = [214, 39, 40]; // colour of an unlikely token
const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1", "#edc948", "#9c755f", "#ff9da7", "#bab0ac"];
const OUTCOMES = { all_fail: "none correct", mixed: "some correct", all_correct: "all correct", solved: "at least one correct" };

const view = document.getElementById("view");
const tip = document.getElementById("tip");
let modelOrder = []; // model ids from /v1/stats, sorted: a model's colour is the same on every view
let current = null; // {refresh: async () => void} of the view on screen
let knownGroups = null; // /v1/health's group count when the view was last read

// ------------------------------------------------------------------------------------------- helpers

function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "style") node.style.cssText = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  for (const child of children.flat(Infinity)) if (child) node.append(child instanceof Node ? child : String(child));
  return node;
}

// a view that cannot be shown for a reason found here (a malformed id in the URL), before asking the store
class ViewError extends Error {}

class ApiError extends Error {
  constructor(status, message, path) {
    super(message);
    this.status = status;
    this.path = path;
  }
}

async function api(path) {
  let response;
  try {
    response = await fetch(path, { headers: { Accept: "application/json" } });
  } catch (err) {
    throw new ApiError(0, `the store did not answer (${err.message}): is graft-store serve still running?`, path);
  }
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new ApiError(response.status, body?.error ?? `${response.status} ${response.statusText}`, path);
  return body;
}

function query(params) {
  const search = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) if (value !== null && value !== undefined && value !== "") search.set(key, value);
  const text = search.toString();
  return text ? `?${text}` : "";
}

// a table's header row; the columns named in `numeric` are right-aligned like their numbers
function headRow(labels, numeric = []) {
  return h("thead", {}, h("tr", {}, labels.map((c) => h("th", { class: numeric.includes(c) ? "n" : null }, c))));
}

function link(href, ...children) {
  return h("a", { href, "data-link": true }, ...children);
}

const pct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);
const num = (x) => (x === null || x === undefined ? "–" : Number(x).toLocaleString("en-US"));
const signed = (x) => (x > 0 ? "+" : "") + x.toFixed(3);
const utc = (iso) => (iso ? iso.replace("T", " ").replace(/\.\d+/, "").replace(/(\+00:00|Z)$/, " UTC") : "–");
const isPromptId = (text) => /^[0-9a-f]{16}$/.test(text);

function modelColour(model) {
  let i = modelOrder.indexOf(model);
  if (i < 0) i = [...model].reduce((a, c) => (a * 31 + c.charCodeAt(0)) >>> 0, 7); // a model newer than the stats read
  return PALETTE[i % PALETTE.length];
}

function modelChip(model) {
  return h("span", { class: "model" }, h("i", { style: `background:${modelColour(model)}` }), model);
}

// The colour of a token with this logprob: white at p = 1, LOW at p <= 0.001, linear in -logprob between.
export function tokenColour(logprob) {
  const u = Math.min(1, Math.max(0, -logprob / LOGPROB_FULL_COLOUR));
  const [r, g, b] = LOW.map((c) => Math.round(255 + (c - 255) * u));
  return { background: `rgb(${r}, ${g}, ${b})`, dark: u > 0.55 };
}

function errorBox(err) {
  const status = err.status ? ` (HTTP ${err.status})` : "";
  return h("div", { class: "error", role: "alert" },
    h("strong", {}, err instanceof ApiError ? `The store answered${status}:` : err instanceof ViewError ? "Cannot show this:" : "Something went wrong:"),
    " ", err.message,
    err.path ? h("div", { class: "muted" }, "request: ", h("code", {}, err.path)) : null);
}

function outcomeOf(successes, size) {
  if (successes === 0) return ["all-fail", "fail"];
  if (successes === size) return ["all-correct", "pass"];
  return ["informative", "mixed"];
}

function successBar(successes, total) {
  const share = total ? successes / total : 0;
  return h("span", { class: "bar", title: `${successes} of ${total} rollouts correct` },
    h("span", { style: `width:${(100 * share).toFixed(1)}%` }));
}

async function refreshModels() {
  const stats = await api("/v1/stats");
  modelOrder = stats.models.map((m) => m.model_id);
  return stats;
}

// ------------------------------------------------------------------------------------------- overview

async function overview() {
  const [stats, curves, datasets] = await Promise.all([refreshModels(), api("/v1/stats/steps?bins=200"), api("/v1/datasets")]);
  const models = stats.models;
  const totals = h("div", { class: "totals" },
    [["groups", stats.total_groups], ["rollouts", stats.total_rollouts], ["models", models.length],
     ["shard files", stats.files], ["quarantined files", stats.quarantined_files], ["duplicate groups skipped", stats.duplicate_groups]]
      .map(([label, value]) => h("div", { class: "total", "data-total": label }, h("b", {}, num(value)), h("span", {}, label))));
  const table = h("table", { class: "models", id: "models" },
    headRow(["model", "groups", "rollouts", "prompts", "success rate", "informative share", "newest policy step",
      "newest rollout", ""], ["groups", "rollouts", "prompts", "success rate", "informative share", "newest policy step"]),
    h("tbody", {}, models.map((m) => h("tr", { "data-model": m.model_id },
      h("td", {}, modelChip(m.model_id)),
      h("td", { class: "n", "data-field": "groups" }, num(m.groups)),
      h("td", { class: "n", "data-field": "rollouts" }, num(m.rollouts)),
      h("td", { class: "n", "data-field": "prompts" }, num(m.prompts)),
      h("td", { class: "n", "data-field": "success_rate" }, pct(m.success_rate)),
      h("td", { class: "n", "data-field": "informative_share", title: `${num(m.informative_groups)} informative groups` },
        pct(m.groups ? m.informative_groups / m.groups : null)),
      h("td", { class: "n", "data-field": "max_policy_step" }, num(m.max_policy_step)),
      h("td", { class: "muted" }, utc(m.newest_created_at)),
      h("td", {}, link(`/ui/prompts${query({ model: m.model_id })}`, "prompts →"))))));
  const pairs = models.length > 1 ? h("section", { class: "card" },
    h("h2", {}, "Where GRAFT grafts"),
    h("p", { class: "muted" }, "Prompts on which the first model's rollouts all failed and the peer lookup finds a group of the second."),
    h("div", { class: "pairs" }, models.flatMap((a) => models.filter((b) => b !== a).map((b) =>
      link(`/ui/prompts${query({ failed_by: a.model_id, solved_by: b.model_id })}`, modelChip(a.model_id), " failed, ", modelChip(b.model_id), " solved"))))) : null;
  return [
    h("div", { class: "heading" }, h("h1", {}, "Store overview"),
      h("span", { class: "muted" }, "last shard indexed ", utc(stats.last_ingest_at))),
    totals,
    h("section", { class: "card" }, h("h2", {}, "Models"), models.length ? table : h("p", { class: "empty" }, "No groups stored yet.")),
    h("section", { class: "card" }, h("h2", {}, "Success rate over policy step"), successPlot(curves)),
    pairs,
    brokerCard(stats.broker),
    h("section", { class: "card" }, h("h2", {}, "Datasets"),
      datasets.datasets.length ? h("table", { class: "datasets" },
        headRow(["dataset", "prompts with groups", "groups", "rollouts", "problems stored"],
          ["prompts with groups", "groups", "rollouts", "problems stored"]),
        h("tbody", {}, datasets.datasets.map((d) => h("tr", {},
          h("td", {}, link(`/ui/prompts${query({ dataset: d.dataset })}`, d.dataset)),
          h("td", { class: "n" }, num(d.prompts)), h("td", { class: "n" }, num(d.groups)),
          h("td", { class: "n" }, num(d.rollouts)), h("td", { class: "n" }, num(d.problems))))))
        : h("p", { class: "empty" }, "No datasets yet.")),
  ];
}

// wanted prompts (learners' misses, the generators' work) and the served ledger: /v1/stats's broker
function brokerCard(broker) {
  if (!broker) return null;
  const seconds = (x) => (x === null || x === undefined ? "–" : `${x.toFixed(1)} s`);
  return h("section", { class: "card", id: "broker" }, h("h2", {}, "Wanted prompts and the served ledger"),
    h("p", { class: "muted" }, "Prompts learners failed with no peer group to graft, until an informative group of another model lands; groups served to learners (what they grafted)."),
    h("div", { class: "totals" },
      [["wanted now", num(broker.backlog_prompts)], ["wants recorded", num(broker.wants_recorded)],
       ["wants served", num(broker.wants_cleared)], ["wants evicted", num(broker.wants_evicted)],
       ["want to group, median", seconds(broker.want_to_group_s_p50)], ["want to group, p90", seconds(broker.want_to_group_s_p90)],
       [`served within ${broker.within_steps} steps`, pct(broker.served_within_steps_share)],
       ["groups served", num(broker.ledger_groups)], ["ledger entries", num(broker.ledger_entries)]]
        .map(([label, value]) => h("div", { class: "total", "data-broker": label }, h("b", {}, value), h("span", {}, label)))));
}

function successPlot(curves) {
  const series = curves.models.filter((m) => m.points.length);
  if (!series.length) return h("p", { class: "empty" }, "No groups stored yet.");
  const W = 1100, H = 300, left = 52, right = 16, top = 12, bottom = 40;
  const xs = series.flatMap((m) => m.points.map((p) => (p.step_min + p.step_max) / 2));
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  if (x0 === x1) [x0, x1] = [x0 - 1, x1 + 1];
  const X = (x) => left + ((x - x0) / (x1 - x0)) * (W - left - right);
  // the y axis ends at the first of these above every point: low rates (a weak model, early steps) stay readable
  const highest = Math.max(...series.flatMap((m) => m.points.map((p) => p.success_rate ?? 0)));
  const yMax = [0.05, 0.1, 0.2, 0.25, 0.5, 1].find((y) => y >= highest) ?? 1;
  const Y = (y) => top + (1 - y / yMax) * (H - top - bottom);
  const grid = [0, 0.25, 0.5, 0.75, 1].map((f) => f * yMax).map((y) => [
    svg("line", { x1: left, x2: W - right, y1: Y(y), y2: Y(y), class: "grid" }),
    svg("text", { x: left - 6, y: Y(y) + 4, "text-anchor": "end" }, `${+(y * 100).toFixed(2)}%`)]);
  const ticks = niceTicks(x0, x1, 6).map((x) => [
    svg("line", { x1: X(x), x2: X(x), y1: H - bottom, y2: H - bottom + 4, class: "axis" }),
    svg("text", { x: X(x), y: H - bottom + 16, "text-anchor": "middle" }, num(x))]);
  const lines = series.map((m) => {
    const colour = modelColour(m.model_id);
    const points = m.points.filter((p) => p.success_rate !== null);
    const path = points.map((p, i) => `${i ? "L" : "M"}${X((p.step_min + p.step_max) / 2).toFixed(1)},${Y(p.success_rate).toFixed(1)}`).join("");
    return svg("g", { "data-model": m.model_id },
      svg("path", { d: path, stroke: colour, fill: "none", "stroke-width": 2 }),
      points.map((p) => svg("circle", { cx: X((p.step_min + p.step_max) / 2), cy: Y(p.success_rate), r: 3.5, fill: colour },
        svg("title", {}, `${m.model_id}, step ${p.step_min === p.step_max ? p.step_min : `${p.step_min}–${p.step_max}`}: ` +
          `success ${pct(p.success_rate)}, ${num(p.groups)} groups, ${pct(p.informative_groups / p.groups)} informative`))));
  });
  const binNote = curves.bin_width > 1 ? ` (points are bins of ${curves.bin_width} steps)` : "";
  return h("figure", { class: "plot" },
    svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "success rate over policy step per model", id: "success-plot" },
      grid, ticks,
      svg("line", { x1: left, x2: W - right, y1: H - bottom, y2: H - bottom, class: "axis" }),
      svg("text", { x: (left + W - right) / 2, y: H - 6, "text-anchor": "middle", class: "label" }, `policy step${binNote}`),
      lines),
    h("figcaption", {}, series.map((m) => modelChip(m.model_id)),
      h("span", { class: "muted" }, " mean reward over scored rollouts per policy step (hover a point)")));
}

function niceTicks(lo, hi, count) {
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((f) => f * mag).find((s) => s >= raw) || raw;
  const first = Math.ceil(lo / step) * step;
  const ticks = [];
  for (let x = first; x <= hi + 1e-9; x += step) ticks.push(Math.round(x * 1e6) / 1e6);
  return ticks.filter((x) => Number.isInteger(x));
}

// ------------------------------------------------------------------------------------------- prompt list

async function promptList(_, params) {
  const [stats, datasets] = await Promise.all([refreshModels(), api("/v1/datasets")]);
  const state = Object.fromEntries(["q", "dataset", "model", "outcome", "failed_by", "solved_by", "cursor", "page"]
    .map((k) => [k, params.get(k) || ""]));
  const go = (changes) => navigate(`/ui/prompts${query({ ...state, cursor: "", page: "", ...changes })}`);
  const models = stats.models.map((m) => m.model_id);
  const select = (name, options, blank) => h("select", { name, onchange: (e) => go({ [name]: e.target.value }) },
    h("option", { value: "" }, blank),
    options.map(([value, label]) => h("option", { value, selected: value === state[name] }, label)));
  const search = h("input", { type: "search", name: "q", value: state.q, placeholder: "problem text or prompt id", autocomplete: "off" });
  const form = h("form", { class: "filters", id: "filters", onsubmit: (e) => { e.preventDefault(); go({ q: search.value.trim() }); } },
    h("label", {}, "Search ", search), h("button", { type: "submit" }, "Search"),
    h("label", {}, "Dataset ", select("dataset", datasets.datasets.map((d) => [d.dataset, d.dataset]), "any")),
    h("label", {}, "Model ", select("model", models.map((m) => [m, m]), "any")),
    h("label", {}, "Correct ", select("outcome", Object.entries(OUTCOMES), "any")),
    h("span", { class: "graft-filter" },
      h("label", { title: "the prompts the peer lookup would graft for this learner" }, "Failed by ", select("failed_by", models.map((m) => [m, m]), "–")),
      h("label", {}, " solved by ", select("solved_by", models.map((m) => [m, m]), "any peer"))),
    Object.values(state).some(Boolean) ? link("/ui/prompts", "clear") : null);
  const results = h("div", { id: "results" });
  const refresh = async () => {
    if (state.solved_by && !state.failed_by) {
      results.replaceChildren(h("p", { class: "hint" }, "Pick the model that failed (\"Failed by\") to see where the peer solves."));
      return;
    }
    const page = await api(`/v1/prompts${query({ q: state.q, dataset: state.dataset, model: state.model, outcome: state.outcome,
      failed_by: state.failed_by, solved_by: state.solved_by, cursor: state.cursor, limit: PROMPTS_PER_PAGE })}`);
    results.replaceChildren(promptTable(page, state), pager(page, state));
  };
  await refresh();
  return { nodes: [h("div", { class: "heading" }, h("h1", {}, "Prompts"), describeFilters(state)), form, results], refresh };
}

function describeFilters(state) {
  const parts = [];
  if (state.failed_by) parts.push(["failed by ", modelChip(state.failed_by), ", solved by ", state.solved_by ? modelChip(state.solved_by) : "a peer", " (what GRAFT grafts)"]);
  if (state.outcome) parts.push([OUTCOMES[state.outcome], state.model ? [" for ", modelChip(state.model)] : " (every model)"]);
  else if (state.model) parts.push(["with groups of ", modelChip(state.model)]);
  if (state.dataset) parts.push(["in ", h("b", {}, state.dataset)]);
  if (state.q) parts.push(["matching “", h("b", {}, state.q), "”"]);
  return h("span", { class: "muted" }, parts.length ? parts.flatMap((p, i) => (i ? ["; ", p] : [p])) : "newest groups first");
}

function promptTable(page, state) {
  if (!page.prompts.length) return h("p", { class: "empty", id: "no-prompts" }, state.cursor ? "No more prompts." : "No prompts match these filters.");
  return h("table", { class: "prompts", id: "prompt-table" },
    headRow(["prompt", "problem", "gold", "per model: correct rollouts", "groups"], ["groups"]),
    h("tbody", {}, page.prompts.map((p) => h("tr", { "data-prompt": p.prompt_id },
      h("td", {}, link(`/ui/prompt/${p.prompt_id}`, h("code", {}, p.prompt_id)), h("div", { class: "muted small" }, p.dataset)),
      h("td", { class: "problem" }, p.problem === null ? h("span", { class: "muted" }, "(no problem text stored)")
        : link(`/ui/prompt/${p.prompt_id}`, p.problem)),
      h("td", { class: "gold" }, p.answer === null ? "–" : h("code", {}, p.answer)),
      h("td", {}, h("div", { class: "per-model" }, p.models.map((m) => h("div", { "data-model": m.model_id },
        modelChip(m.model_id), successBar(m.successes, m.rollouts),
        h("span", { class: "small" }, `${m.successes}/${m.rollouts}`,
          h("span", { class: "muted" }, ` · ${m.groups} group${m.groups === 1 ? "" : "s"}`))))) ),
      h("td", { class: "n" }, num(p.groups))))));
}

function pager(page, state) {
  const number = Number(state.page || 1);
  return h("div", { class: "pager" },
    state.cursor ? link(`/ui/prompts${query({ ...state, cursor: "", page: "" })}`, "← first page") : null,
    h("span", { class: "muted" }, `page ${number}`),
    page.next_cursor ? link(`/ui/prompts${query({ ...state, cursor: page.next_cursor, page: number + 1 })}`, "next page →") : null);
}

// ------------------------------------------------------------------------------------------- prompt page

async function promptPage(match, params) {
  const promptId = decodeURIComponent(match[1]);
  if (!isPromptId(promptId)) {
    throw new ViewError(`“${promptId}” is not a prompt id: a prompt id is 16 lowercase hex characters (prompt_id() of the problem text). Search for it on the Prompts page instead.`);
  }
  await refreshModels();
  const shown = Math.max(1, Number(params.get("n")) || GROUPS_SHOWN);
  const detail = await api(`/v1/prompts/${promptId}`);
  const columns = await Promise.all(detail.models.map(async (m) => {
    const { groups } = await api(`/v1/prompts/${promptId}/groups${query({ model: m.model_id, limit: Math.min(shown, 256) })}`);
    return modelColumn(m, groups, shown, params);
  }));
  const problem = detail.problems[0];
  return [
    h("div", { class: "crumbs" }, link("/ui/prompts", "Prompts"), " › ", h("code", {}, promptId)),
    h("section", { class: "card problem-card", id: "problem" },
      problem ? [h("div", { class: "problem-text" }, problem.problem),
        h("div", { class: "facts" },
          h("span", {}, "gold answer ", h("code", { id: "gold" }, problem.answer)),
          h("span", {}, "dataset ", detail.problems.map((p) => p.dataset).join(", ")),
          h("span", {}, "prompt ", h("code", {}, promptId)))]
        : h("p", { class: "muted" }, "The store holds no problem text for this prompt (its problems file was never written)."),
      detail.problems.length > 1 && new Set(detail.problems.map((p) => p.answer)).size > 1
        ? h("p", { class: "warn" }, "The datasets disagree on the gold answer: ", detail.problems.map((p) => `${p.dataset}: ${p.answer}`).join("; ")) : null),
    detail.models.length ? h("div", { class: "columns", id: "columns" }, columns)
      : h("p", { class: "empty" }, "No groups stored for this prompt yet."),
  ];
}

function modelColumn(m, groups, shown, params) {
  const more = m.groups > groups.length;
  return h("section", { class: "column", "data-model": m.model_id },
    h("header", {},
      h("h2", {}, modelChip(m.model_id)),
      h("div", { class: "muted small" },
        `${num(m.groups)} group${m.groups === 1 ? "" : "s"} · ${m.successes}/${m.rollouts} correct · ${m.informative_groups} informative · `,
        m.min_policy_step === m.max_policy_step ? `step ${m.min_policy_step}` : `steps ${m.min_policy_step}–${m.max_policy_step}`)),
    groups.map((g) => groupCard(g)),
    more ? h("div", { class: "more" },
      h("span", { class: "muted small" }, `newest ${groups.length} of ${m.groups} groups shown`),
      link(`${location.pathname}${query({ ...Object.fromEntries(params), n: shown + GROUPS_SHOWN })}`, "show more")) : null);
}

function groupCard(group) {
  const rollouts = group.rollouts;
  const first = rollouts[0];
  const successes = rollouts.filter((r) => r.correct).length;
  const [label, kind] = outcomeOf(successes, rollouts.length);
  return h("article", { class: "group", "data-group": first.group_id },
    h("header", {},
      h("b", {}, `step ${first.policy_step}`),
      h("span", { class: `badge ${kind}` }, `${successes}/${rollouts.length} · ${label}`),
      h("span", { class: "muted small", title: first.group_id }, utc(first.created_at)),
      servedNote(first.group_id)),
    h("table", { class: "rollouts" },
      headRow(["", "reward", "adv.", "answer", "finish", "tokens", "completion"], ["reward", "adv.", "tokens"]),
      h("tbody", {}, rollouts.map((r, i) => {
        const href = `/ui/rollout/${encodeURIComponent(r.group_id)}/${i}`;
        return h("tr", { class: r.correct ? "ok" : "bad", "data-rollout": r.rollout_id },
          h("td", {}, link(href, `#${i}`)),
          h("td", { class: "n" }, r.reward === null ? "–" : r.reward.toFixed(2)),
          h("td", { class: "n" }, signed(r.advantage)),
          h("td", { class: "answer" }, r.extracted_answer === null ? h("span", { class: "muted" }, "none") : h("code", {}, r.extracted_answer)),
          h("td", { class: r.finish_reason === "stop" ? "muted" : "warn" }, r.finish_reason),
          h("td", { class: "n" }, r.num_tokens),
          h("td", { class: "text" }, link(href, r.completion_text || "(empty)")));
      }))));
}

// how often the group was served (the store's ledger), filled in when its answer comes
function servedNote(groupId) {
  const note = h("span", { class: "muted small served", "data-served": "" });
  api(`/v1/groups/${encodeURIComponent(groupId)}/served`).then((byLearner) => {
    const entries = Object.entries(byLearner);
    const total = entries.reduce((sum, [, times]) => sum + times, 0);
    note.textContent = total ? `served ${total}×` : "never served";
    note.title = entries.map(([learner, times]) => `${learner}: ${times}`).join(", ");
    note.dataset.served = String(total);
  }).catch(() => { note.textContent = ""; });
  return note;
}

// ------------------------------------------------------------------------------------------- rollout view

async function rolloutPage(match) {
  const groupId = decodeURIComponent(match[1]);
  const position = Number(match[2]);
  await refreshModels();
  const group = await api(`/v1/groups/${encodeURIComponent(groupId)}`);
  const rollout = group.rollouts[position];
  if (!rollout) throw new ViewError(`group ${groupId} has ${group.rollouts.length} rollouts (#0 to #${group.rollouts.length - 1}); there is no #${position}.`);
  const [tokens, detail] = await Promise.all([
    api(`/v1/groups/${encodeURIComponent(groupId)}/tokens${query({ rollout_id: rollout.rollout_id })}`),
    api(`/v1/prompts/${rollout.prompt_id}`).catch(() => null)]);
  const pieces = tokens.rollouts[0].pieces;
  const special = tokens.rollouts[0].special;
  const problem = detail?.problems?.[0];
  // logprobs_mode "none": the row's source gave no behaviour logprobs (mu unknown), so no token has a probability
  const hasMu = rollout.logprobs_mode !== "none";
  const logprobs = rollout.token_logprobs;
  const meanLogprob = hasMu && logprobs.length ? logprobs.reduce((a, b) => a + b, 0) / logprobs.length : null;
  const base = `/ui/rollout/${encodeURIComponent(groupId)}/`;
  const stream = h("div", { class: `tokens${pieces ? "" : " ids"}`, id: "tokens" },
    rollout.completion_token_ids.map((id, i) => {
      const colour = hasMu ? tokenColour(logprobs[i]) : { dark: false, background: "transparent" };
      const text = pieces ? (special[i] ? pieces[i] : visible(pieces[i])) : `${id}`;
      return h("span", {
        class: `tok${colour.dark ? " dark" : ""}${pieces && special[i] ? " special" : ""}${pieces && pieces[i] === "" ? " partial" : ""}`,
        style: `background-color:${colour.background}`,
        dataset: hasMu ? { i, id, logprob: logprobs[i] } : { i, id },
      }, text);
    }));
  const unlikely = hasMu ? logprobs.map((lp, i) => [lp, i]).sort((a, b) => a[0] - b[0]).slice(0, 8) : [];
  return [
    h("div", { class: "crumbs" }, link("/ui/prompts", "Prompts"), " › ",
      link(`/ui/prompt/${rollout.prompt_id}`, h("code", {}, rollout.prompt_id)), " › ",
      modelChip(rollout.model_id), ` step ${rollout.policy_step}, rollout #${position} of ${group.rollouts.length}`),
    h("div", { class: "heading" },
      h("h1", {}, `${rollout.correct ? "✓ correct" : "✗ incorrect"}`, h("span", { class: "muted" }, ` · answer `),
        rollout.extracted_answer === null ? h("span", { class: "muted" }, "none") : h("code", {}, rollout.extracted_answer),
        problem ? [h("span", { class: "muted" }, " · gold "), h("code", {}, problem.answer)] : null),
      h("span", { class: "stepper" },
        position > 0 ? link(`${base}${position - 1}`, "← previous") : null,
        position + 1 < group.rollouts.length ? link(`${base}${position + 1}`, "next →") : null)),
    h("div", { class: "facts card", id: "facts" },
      [["reward", rollout.reward === null ? "unscored" : rollout.reward.toFixed(3)], ["advantage", signed(rollout.advantage)],
       ["finish", rollout.finish_reason], ["tokens", rollout.num_tokens], ["bytes", rollout.num_bytes],
       ["logprob sum (no EOS)", hasMu ? rollout.logprob_sum.toFixed(3) : "–"], ["mean token logprob", meanLogprob === null ? "–" : meanLogprob.toFixed(3)],
       ["temperature", rollout.temperature], ["top_p", rollout.top_p], ["logprobs", rollout.logprobs_mode],
       ["created", utc(rollout.created_at)], ["tokenizer", rollout.tokenizer_id]]
        .map(([k, v]) => h("span", {}, h("small", {}, k), h("b", {}, String(v))))),
    problem ? h("details", { class: "card", open: true }, h("summary", {}, "Problem"), h("div", { class: "problem-text" }, problem.problem)) : null,
    h("section", { class: "card" },
      h("h2", {}, hasMu ? "Tokens, coloured by the behaviour policy's probability" : "Tokens"),
      hasMu ? legend() : h("p", { class: "warn", id: "no-mu-note" },
        "No behaviour logprobs: this row's source gave none (logprobs mode 'none'), so no token has a probability."),
      h("p", { class: tokens.decoded ? "muted small" : "warn", id: "token-note" }, tokens.note,
        pieces ? (hasMu ? ". Hover a token for its text, id and probability." : ". Hover a token for its text and id.")
          : ". Each box is a token id; the completion text follows."),
      stream,
      pieces ? null : h("pre", { class: "completion", id: "completion" }, rollout.completion_text)),
    !hasMu ? null : h("section", { class: "card" }, h("h2", {}, "Least likely tokens"),
      h("table", { class: "unlikely" },
        headRow(["position", "token", "id", "probability", "logprob"], ["position", "id", "probability", "logprob"]),
        h("tbody", {}, unlikely.map(([lp, i]) => h("tr", { onclick: () => flash(i) },
          h("td", { class: "n" }, i), h("td", {}, h("code", {}, pieces ? quoteToken(pieces[i]) : "–")),
          h("td", { class: "n" }, rollout.completion_token_ids[i]), h("td", { class: "n" }, Math.exp(lp).toFixed(4)),
          h("td", { class: "n" }, lp.toFixed(3))))))),
  ];
}

function visible(piece) {
  // keep line breaks as breaks, but show that they are there
  return piece.replace(/\n/g, "↵\n");
}

function quoteToken(piece) {
  return JSON.stringify(piece);
}

function legend() {
  const stops = [1, 0.5, 0.1, 0.01, 0.001];
  return h("div", { class: "legend" }, h("span", { class: "muted small" }, "probability"),
    stops.map((p) => {
      const colour = tokenColour(Math.log(p));
      return h("span", { class: `tok${colour.dark ? " dark" : ""}`, style: `background-color:${colour.background}` }, p === 0.001 ? "≤ 0.001" : String(p));
    }));
}

function flash(i) {
  const node = document.querySelector(`#tokens .tok[data-i="${i}"]`);
  if (!node) return;
  node.scrollIntoView({ block: "center", behavior: "smooth" });
  node.classList.remove("flash");
  void node.offsetWidth;
  node.classList.add("flash");
}

function showTip(event) {
  const node = event.target.closest?.("#tokens .tok");
  if (!node) { tip.hidden = true; return; }
  const rollout = node.closest("#tokens");
  const lp = node.dataset.logprob === undefined ? null : Number(node.dataset.logprob);
  const hasText = !rollout.classList.contains("ids");
  const piece = hasText ? node.textContent.replace(/↵\n/g, "\n") : null;
  tip.replaceChildren(
    hasText ? h("div", {}, h("code", {}, quoteToken(piece)), node.classList.contains("partial") ? h("span", { class: "muted" }, " (part of a character the next token completes)") : null) : null,
    h("div", {}, `id ${node.dataset.id} · position ${node.dataset.i}`),
    lp === null ? h("div", { class: "muted" }, "no behaviour logprob")
      : h("div", {}, h("b", {}, `p = ${Math.exp(lp).toFixed(4)}`), ` · logprob ${lp.toFixed(4)}`));
  tip.hidden = false;
  const box = node.getBoundingClientRect();
  tip.style.left = `${Math.min(window.innerWidth - tip.offsetWidth - 8, Math.max(8, box.left))}px`;
  tip.style.top = `${box.bottom + 6 + window.scrollY}px`;
}

// ------------------------------------------------------------------------------------------- routing

const ROUTES = [
  [/^\/ui\/?$/, overview, "overview"],
  [/^\/ui\/prompts\/?$/, promptList, "prompts"],
  [/^\/ui\/prompt\/([^/]+)\/?$/, promptPage, "prompts"],
  [/^\/ui\/rollout\/([^/]+)\/(\d+)\/?$/, rolloutPage, null],
];

async function render() {
  tip.hidden = true;
  const route = ROUTES.find(([pattern]) => pattern.test(location.pathname));
  document.querySelectorAll("[data-nav]").forEach((a) => a.classList.toggle("active", route?.[2] === a.dataset.nav));
  const params = new URLSearchParams(location.search);
  const started = location.href;
  let rendered;
  try {
    if (!route) throw new ViewError(`no view at ${location.pathname}: try the overview (/ui/) or the prompts (/ui/prompts).`);
    const health = await api("/v1/health");
    const result = await route[1](location.pathname.match(route[0]), params);
    rendered = Array.isArray(result) ? { nodes: result, refresh: null } : result;
    knownGroups = health.groups;
  } catch (err) {
    rendered = { nodes: [errorBox(err)], refresh: null };
  }
  if (location.href !== started) return; // the reader moved on meanwhile
  view.replaceChildren(...[rendered.nodes].flat(Infinity).filter(Boolean));
  view.dataset.ready = location.pathname + location.search;
  // a rollout never changes; the other views re-read the store when it grew
  current = route && route[1] !== rolloutPage ? { refresh: rendered.refresh || (() => render()) } : null;
  stamp();
}

function stamp() {
  document.getElementById("updated").textContent = `read ${new Date().toLocaleTimeString("en-GB")}`;
}

function navigate(href) {
  history.pushState(null, "", href);
  window.scrollTo(0, 0);
  render();
}

async function poll() {
  if (!document.getElementById("auto").checked || !current || document.hidden) return;
  try {
    const { groups } = await api("/v1/health");
    if (groups !== knownGroups) {
      knownGroups = groups;
      await current.refresh();
      view.dataset.groups = groups;
      stamp();
    }
  } catch (err) {
    document.getElementById("updated").textContent = `store not answering (${err.message})`;
  }
}

document.addEventListener("click", (event) => {
  const a = event.target.closest("a[data-link]");
  if (!a || event.ctrlKey || event.metaKey || event.shiftKey || event.button !== 0) return;
  event.preventDefault();
  navigate(a.getAttribute("href"));
});
document.addEventListener("mouseover", showTip);
window.addEventListener("popstate", render);
document.getElementById("refresh").addEventListener("click", async () => {
  if (current) {
    try { await current.refresh(); } catch (err) { view.replaceChildren(errorBox(err)); }
    stamp();
  } else render();
});
setInterval(poll, AUTO_REFRESH_MS);
render();
