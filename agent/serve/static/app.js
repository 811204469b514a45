// The page of `sleuth serve`: asks the streaming /v1/chat/completions and shows the episode as it runs.
// Everything the server sends (reasoning, queries, passages, answers, error messages) is put on the page
// with textContent: it is never parsed as HTML.
"use strict";

const KEY_STORE = "sleuth.apiKey"; // sessionStorage: this tab only, gone when it closes
const HISTORY_STORE = "sleuth.history";
const HISTORY_SIZE = 5;

const $ = (id) => document.getElementById(id);
const ui = {
  form: $("ask-form"), question: $("question"), ask: $("ask"), stop: $("stop"),
  keyBox: $("key-box"), key: $("api-key"), topK: $("top-k"), topKHint: $("top-k-hint"),
  maxTurns: $("max-turns"), maxTurnsHint: $("max-turns-hint"), golds: $("golds"),
  status: $("status"), error: $("error"), run: $("run"), runQuestion: $("run-question"), steps: $("steps"),
  answerBox: $("answer-box"), answer: $("answer"), stopReason: $("stop-reason"), verdict: $("verdict"),
  evidence: $("evidence"), historyBox: $("history-box"), history: $("history"), model: $("model"),
};
let running = null; // the AbortController of the request in flight

function el(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function setStatus(text) { ui.status.textContent = text; }

function showError(text) {
  ui.error.textContent = text;
  ui.error.hidden = !text;
}

function storedKey() {
  try { return sessionStorage.getItem(KEY_STORE) || ""; } catch { return ""; }
}

function authHeaders() {
  const key = ui.key.value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}

async function errorMessage(resp) {
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) return String(body.error.message);
    return JSON.stringify(body);
  } catch {
    return resp.statusText || "no reason given";
  }
}

function askForKey(focus) {
  ui.keyBox.hidden = false;
  if (focus) { ui.key.focus(); ui.key.select(); }
}

// -- settings within the server's limits (GET /health) ---------------------------------------------
async function loadLimits() {
  let health;
  try {
    const resp = await fetch("health");
    if (!resp.ok) return;
    health = await resp.json();
  } catch { return; }
  if (health.model) ui.model.textContent = "model: " + health.model;
  const lim = health.limits;
  if (!lim) return;
  ui.topK.max = lim.max_top_k; ui.topK.value = lim.top_k;
  ui.topKHint.textContent = `1 to ${lim.max_top_k}; the server's default is ${lim.top_k}.`;
  ui.maxTurns.max = lim.max_turns; ui.maxTurns.value = lim.max_turns;
  ui.maxTurnsHint.textContent = `1 to ${lim.max_turns}, the server's limit.`;
  if (lim.max_question_chars) ui.question.maxLength = lim.max_question_chars;
}

// Whether this server wants a key: ask a route that needs one when a key is set.
async function probeKey() {
  try {
    const resp = await fetch("v1/models", { headers: authHeaders() });
    if (resp.status === 401) askForKey(!ui.key.value);
  } catch { /* the first question will say what is wrong */ }
}

// -- the recent questions of this tab ----------------------------------------------------------------
function loadHistory() {
  try { return JSON.parse(sessionStorage.getItem(HISTORY_STORE) || "[]").filter((h) => h && typeof h.question === "string"); }
  catch { return []; }
}

function saveHistory(items) {
  try { sessionStorage.setItem(HISTORY_STORE, JSON.stringify(items.slice(0, HISTORY_SIZE))); } catch { /* full */ }
  renderHistory();
}

function remember(question, answer) {
  const items = loadHistory().filter((h) => h.question !== question);
  items.unshift({ question, answer });
  saveHistory(items);
}

function renderHistory() {
  const items = loadHistory();
  ui.history.replaceChildren();
  for (const h of items) {
    const li = el("li");
    const b = el("button", "linklike", h.question);
    b.type = "button";
    b.title = "Ask again";
    b.addEventListener("click", () => { ui.question.value = h.question; ui.question.focus(); });
    li.append(b);
    if (typeof h.answer === "string") li.append(el("span", "muted", " → " + (h.answer || "(no answer)")));
    ui.history.append(li);
  }
  ui.historyBox.hidden = items.length === 0;
}

// -- rendering the episode ---------------------------------------------------------------------------
function score(x) { return typeof x === "number" ? x.toFixed(3) : String(x); }

function passageItem(p) {
  const li = el("li", "passage");
  const head = el("p", "passage-head");
  head.append(el("span", "title", p.title || "(untitled)"), " ", el("span", "id", p.id),
              " ", el("span", "score", "score " + score(p.score)));
  li.append(head, el("p", "text", p.text));
  return li;
}

function addTurn(ev, reasoning) {
  const li = el("li", "step turn");
  li.dataset.kind = "turn";
  li.append(el("h3", null, `Turn ${ev.turn} · ${ev.action}`));
  if (ev.judgement) li.append(el("p", "judgement", "Self-judge of the last search: " + ev.judgement));
  li.append(el("pre", "reasoning", reasoning));
  if (ev.error) li.append(el("p", "invalid", "Invalid action: " + ev.error));
  ui.steps.append(li);
}

function addSearch(ev) {
  const li = el("li", "step search");
  li.dataset.kind = "search";
  const h = el("h3", null, `Search (turn ${ev.turn}): `);
  h.append(el("q", "query", ev.query));
  li.append(h);
  const list = el("ol", "passages");
  for (const p of ev.hits || (ev.doc_ids || []).map((id) => ({ id, title: "", text: "", score: "" }))) {
    list.append(passageItem(p));
  }
  if (!list.children.length) li.append(el("p", "muted", "No passage found."));
  li.append(list);
  ui.steps.append(li);
}

function showVerdict(verdict) {
  ui.verdict.replaceChildren();
  if (!verdict) { ui.verdict.hidden = true; return; }
  for (const [k, v] of Object.entries(verdict)) {
    ui.verdict.append(el("dt", null, k), el("dd", null, typeof v === "number" ? String(Math.round(v * 1000) / 1000) : JSON.stringify(v)));
  }
  ui.verdict.hidden = false;
}

function finish(info, answer) {
  ui.answerBox.hidden = false;
  ui.answer.textContent = answer || "(no answer)";
  const reason = { answer: "answered", max_turns: "no answer within the turn limit",
                   max_tokens: "no answer within the token budget" }[info.stop_reason] || info.stop_reason;
  ui.stopReason.textContent = `${reason}; ${info.searches} search${info.searches === 1 ? "" : "es"}`;
  showVerdict(info.verdict);
  ui.evidence.replaceChildren();
  for (const d of info.evidence || []) {
    const contents = String(d.contents || "");
    const nl = contents.indexOf("\n");
    const text = nl >= 0 && contents.slice(0, nl).trim() === String(d.title || "").trim() ? contents.slice(nl + 1) : contents;
    // compact: each passage was shown with its search (and this query's score) above
    const li = el("li", "passage");
    const details = el("details");
    const summary = el("summary");
    summary.append(el("span", "title", d.title || "(untitled)"), " ", el("span", "id", d.id));
    details.append(summary, el("p", "text", text));
    li.append(details);
    ui.evidence.append(li);
  }
  if (!ui.evidence.children.length) ui.evidence.append(el("li", "muted", "none"));
}

// -- the request -------------------------------------------------------------------------------------
async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data) yield data;
    }
  }
}

function requestBody(question) {
  const body = { stream: true, messages: [{ role: "user", content: question }] };
  const k = parseInt(ui.topK.value, 10), turns = parseInt(ui.maxTurns.value, 10);
  if (Number.isInteger(k)) body.top_k = k;
  if (Number.isInteger(turns)) body.max_turns = turns;
  const golds = ui.golds.value.split("\n").map((s) => s.trim()).filter(Boolean);
  if (golds.length) body.golden_answers = golds;
  return body;
}

function setRunning(controller) {
  running = controller;
  ui.ask.disabled = !!controller;
  ui.stop.disabled = !controller;
  ui.run.setAttribute("aria-busy", controller ? "true" : "false");
}

async function ask(question) {
  const controller = new AbortController();
  setRunning(controller);
  showError("");
  ui.run.hidden = false;
  ui.runQuestion.textContent = question;
  ui.steps.replaceChildren();
  ui.answerBox.hidden = true;
  ui.answer.textContent = "";
  remember(question, null);
  setStatus("Asking…");
  let answer = "", finished = false;
  try {
    const resp = await fetch("v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(requestBody(question)),
    });
    if (!resp.ok) {
      const why = await errorMessage(resp);
      if (resp.status === 401) {
        askForKey(true);
        showError(`Wrong or missing API key: the server answered 401 (${why}). Enter the key and ask again.`);
      } else {
        showError(`The server answered ${resp.status}: ${why}`);
      }
      setStatus("Failed.");
      return;
    }
    for await (const data of sseData(resp.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) {
        showError(`The episode failed (${chunk.error.code || chunk.error.type}): ${chunk.error.message}`);
        setStatus("Failed.");
        return;
      }
      const choice = (chunk.choices || [])[0] || {};
      const delta = choice.delta || {};
      const ev = chunk.sleuth || {};
      if (ev.event === "turn") {
        addTurn(ev, String(delta.reasoning_content || "").replace(/^\n\n/, ""));
        setStatus(ev.action === "search" ? `Turn ${ev.turn}: searching…` : `Turn ${ev.turn}: ${ev.action}`);
      } else if (ev.event === "search") {
        addSearch(ev);
        setStatus(`Turn ${ev.turn}: read ${(ev.hits || ev.doc_ids || []).length} passages for “${ev.query}”.`);
      }
      if (delta.content) answer += delta.content;
      if (choice.finish_reason) {
        finish(ev, answer);
        finished = true;
      }
    }
    if (finished) {
      setStatus(answer ? "Answered." : "Finished without an answer.");
      remember(question, answer);
    } else {
      showError("The connection closed before the episode finished.");
      setStatus("Failed.");
    }
  } catch (e) {
    if (controller.signal.aborted) {
      setStatus("Stopped: the episode was cancelled.");
    } else {
      showError("The request failed: " + (e && e.message ? e.message : String(e)));
      setStatus("Failed.");
    }
  } finally {
    const hadFocus = document.activeElement === ui.stop;
    setRunning(null);
    if (hadFocus) ui.question.focus(); // the stop button is disabled now: keep the focus on the page
  }
}

function stop() {
  if (running) running.abort();
}

// -- wiring ------------------------------------------------------------------------------------------
ui.form.addEventListener("submit", (e) => {
  e.preventDefault();
  const question = ui.question.value.trim();
  if (!question || running) return;
  ask(question);
});
ui.question.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    ui.form.requestSubmit();
  }
});
ui.stop.addEventListener("click", stop);
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && running) { e.preventDefault(); stop(); }
});
ui.key.addEventListener("input", () => {
  try {
    if (ui.key.value) sessionStorage.setItem(KEY_STORE, ui.key.value);
    else sessionStorage.removeItem(KEY_STORE);
  } catch { /* storage refused: the key lives in the field alone */ }
});

ui.key.value = storedKey();
if (ui.key.value) ui.keyBox.hidden = false;
renderHistory();
loadLimits();
probeKey();
