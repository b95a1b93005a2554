// The web chat page served at GET /: one self-contained HTML file (no external scripts, styles
// or fonts, so it works on a machine without internet access) that streams replies from
// /v1/chat/completions, shows the decoding speed and the model's GPU/CPU neuron split from
// /v1/pinfer/info, and keeps an API key (for --api-key) in localStorage.
#pragma once

namespace pinfer::gateway {

inline constexpr char kChatPageHtml[] = R"PINFER_HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>pinfer chat</title>
<style>
body{font-family:system-ui,sans-serif;margin:0;background:#f4f5f7;color:#222;display:flex;flex-direction:column;height:100vh}
header{background:#1f2937;color:#fff;padding:8px 16px;display:flex;gap:16px;align-items:center;flex-wrap:wrap}
header b{font-size:18px} header span{font-size:13px;opacity:.85}
#temperature{width:56px;font-size:13px}
#key{margin-left:auto;font-size:13px;padding:3px 6px;width:180px}
#log{flex:1;overflow-y:auto;padding:16px}
.msg{max-width:760px;margin:0 auto 12px;padding:10px 14px;border-radius:8px;white-space:pre-wrap;line-height:1.4}
.user{background:#dbeafe}.assistant{background:#fff;border:1px solid #ddd}.error{background:#fee2e2}
.stats{font-size:12px;color:#666;max-width:760px;margin:-8px auto 12px}
form{display:flex;gap:8px;padding:12px 16px;background:#fff;border-top:1px solid #ddd}
textarea{flex:1;font:inherit;padding:8px;height:48px;resize:vertical}
button{font:inherit;padding:0 18px}
</style></head><body>
<header><b>pinfer</b><span id="model">model: ?</span><span id="split">GPU/CPU neurons: ?</span>
<span id="speed">tokens/s: -</span>
<label><span>temperature</span> <input id="temperature" type="number" min="0" max="2" step="0.1" value="0.7"></label>
<label><input id="key" type="password" placeholder="API key (optional)"></label></header>
<div id="log"></div>
<form id="form"><textarea id="input" placeholder="Say something (Enter sends, Shift+Enter: new line)"></textarea>
<button id="send" type="submit">Send</button></form>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const history = [];
$("key").value = localStorage.getItem("pinfer-api-key") || "";
$("key").addEventListener("change", () => { localStorage.setItem("pinfer-api-key", $("key").value); loadInfo(); });
function headers() {
  const h = {"Content-Type": "application/json"};
  if ($("key").value) h["Authorization"] = "Bearer " + $("key").value;
  return h;
}
function add(cls, text) {
  const d = document.createElement("div"); d.className = "msg " + cls; d.textContent = text;
  $("log").appendChild(d); $("log").scrollTop = $("log").scrollHeight; return d;
}
async function loadInfo() {
  try {
    const r = await fetch("/v1/pinfer/info", {headers: headers()});
    const j = await r.json();
    if (!r.ok) { $("model").textContent = "model: " + (j.error ? j.error.message : r.status); return; }
    $("model").textContent = "model: " + j.model;
    const p = j.placement, t = p.gpu_neurons + p.cpu_neurons;
    $("split").textContent = t ? `GPU/CPU neurons: ${(100 * p.gpu_neurons / t).toFixed(1)}% / ${(100 * p.cpu_neurons / t).toFixed(1)}%` +
      (p.gpu_backend ? ` (${p.gpu_backend})` : "") : "GPU/CPU neurons: dense";
  } catch (e) { $("model").textContent = "model: unreachable"; }
}
async function send(text) {
  history.push({role: "user", content: text});
  add("user", text);
  const out = add("assistant", "");
  const stats = document.createElement("div"); stats.className = "stats"; $("log").appendChild(stats);
  $("send").disabled = true;
  let reply = "", tokens = 0, first = 0;
  const start = performance.now();
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(),
      body: JSON.stringify({messages: history, stream: true, stream_options: {include_usage: true},
                           temperature: parseFloat($("temperature").value) || 0})});
    if (!r.ok) { const j = await r.json().catch(() => ({})); throw new Error(j.error ? j.error.message : "HTTP " + r.status); }
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const ev = buf.slice(0, i); buf = buf.slice(i + 2);
        if (!ev.startsWith("data: ")) continue;
        const data = ev.slice(6);
        if (data === "[DONE]") continue;
        const j = JSON.parse(data);
        if (j.error) throw new Error(j.error.message);
        if (j.usage) tokens = j.usage.completion_tokens;
        const c = j.choices && j.choices[0];
        if (c && c.delta && c.delta.content) {
          if (!first) first = performance.now();
          reply += c.delta.content; out.textContent = reply;
          if (!j.usage) tokens++;
          $("log").scrollTop = $("log").scrollHeight;
        }
      }
    }
    const secs = (performance.now() - (first || start)) / 1000;
    const tps = tokens > 1 && secs > 0 ? ((tokens - 1) / secs).toFixed(1) : "-";
    $("speed").textContent = "tokens/s: " + tps;
    stats.textContent = `${tokens} tokens, ${tps} tokens/s, first token after ${((first || performance.now()) - start).toFixed(0)} ms`;
    history.push({role: "assistant", content: reply});
  } catch (e) {
    out.className = "msg error"; out.textContent = "error: " + e.message; history.pop();
  } finally { $("send").disabled = false; }
}
$("form").addEventListener("submit", (e) => {
  e.preventDefault(); const t = $("input").value.trim(); if (!t) return; $("input").value = ""; send(t);
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("form").requestSubmit(); }
});
loadInfo();
</script></body></html>
)PINFER_HTML";

}  // namespace pinfer::gateway
