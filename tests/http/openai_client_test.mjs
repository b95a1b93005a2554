// The OpenAI-compatible HTTP API driven by the official OpenAI client (npm `openai`), against
// `pinfer serve` on the bundled model with an API key. References are independent of the HTTP
// code: `pinfer generate` (the engine in-process, no service) for the text and token counts, and
// OpenAI's documented shapes and status codes for the rest. Bad input (malformed JSON, a body
// over the limit, wrong types, unknown model, a bad key, a client that sends slowly, a client
// that leaves mid-stream or before its reply) must get its status with an error object and leave the service serving.
//
//   node tests/http/openai_client_test.mjs --pinfer build/cli/pinfer --model models/relu-llama-tiny
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import fs from "node:fs";
import net from "node:net";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { test, after, before } from "node:test";

import { generateReference, importOrSkip, parseArgs, scrape, startService } from "./service.mjs";

const { default: OpenAI } = await importOrSkip("openai");
const args = parseArgs(process.argv.slice(2));
const KEY = "sk-test-" + Math.random().toString(36).slice(2);
const PROMPT = "Once upon a time";
const MAX_TOKENS = 12;
const REPO = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
const TEMPLATE = path.join(REPO, "examples/chat-templates/chatml.jinja");
const MESSAGES = [{ role: "system", content: "You are a storyteller." },
                  { role: "user", content: "Tell me about a dog." }];

let service, client, modelId;
before(async () => {
  service = await startService({ ...args, apiKey: KEY, extra: ["--chat-template", TEMPLATE] });
  client = new OpenAI({ baseURL: `${service.url}/v1`, apiKey: KEY, maxRetries: 0 });
});
after(async () => {
  if (service) await service.stop();
});

// A raw request: the client library would reject some of these before sending.
async function post(path, body, headers = {}) {
  const res = await fetch(service.url + path, {
    method: "POST",
    headers: { Authorization: `Bearer ${KEY}`, "Content-Type": "application/json", ...headers },
    body: typeof body === "string" ? body : JSON.stringify(body),
  });
  const text = await res.text();
  return { status: res.status, body: text ? JSON.parse(text) : null };
}

function assertError(r, status, param) {
  assert.equal(r.status, status, JSON.stringify(r.body));
  assert.equal(typeof r.body.error.message, "string");
  assert.ok(r.body.error.message.length > 0);
  assert.equal(typeof r.body.error.type, "string");
  if (param !== undefined) assert.equal(r.body.error.param, param);
}

async function stillServes() {
  const c = await client.completions.create({ prompt: PROMPT, max_tokens: 2, temperature: 0 });
  assert.equal(c.usage.completion_tokens, 2);
}

test("models lists the served model", async () => {
  const list = await client.models.list();
  assert.equal(list.data.length, 1);
  modelId = list.data[0].id;
  assert.equal(modelId, args.model.replace(/\/+$/, "").split("/").pop());
  assert.equal((await client.models.retrieve(modelId)).id, modelId);
});

test("completion at temperature 0 equals pinfer generate", async () => {
  const ref = generateReference(args.pinfer, args.model, PROMPT, MAX_TOKENS);
  const c = await client.completions.create({
    model: modelId, prompt: PROMPT, max_tokens: MAX_TOKENS, temperature: 0, logprobs: 0 });
  assert.equal(c.object, "text_completion");
  assert.equal(c.choices[0].text, ref.text);
  assert.equal(c.choices[0].finish_reason, ref.finish_reason === "length" ? "length" : "stop");
  assert.equal(c.usage.prompt_tokens, ref.prompt_ids.length);
  assert.equal(c.usage.completion_tokens, ref.generated_ids.length);
  assert.equal(c.usage.total_tokens, ref.prompt_ids.length + ref.generated_ids.length);
  const lp = c.choices[0].logprobs.token_logprobs;
  assert.equal(lp.length, ref.generated_ids.length);
  for (const v of lp) assert.ok(v <= 0 && Number.isFinite(v), `logprob ${v}`);
});

test("streamed completion adds up to the same text, with usage and [DONE]", async () => {
  const ref = generateReference(args.pinfer, args.model, PROMPT, MAX_TOKENS);
  const stream = await client.completions.create({
    prompt: PROMPT, max_tokens: MAX_TOKENS, temperature: 0, stream: true,
    stream_options: { include_usage: true } });
  let text = "", chunks = 0, usage = null, finish = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const ch of chunk.choices) {
      text += ch.text;
      chunks += 1;
      if (ch.finish_reason) finish = ch.finish_reason;
    }
  }
  assert.equal(text, ref.text);
  assert.ok(chunks > 1, `${chunks} chunks: not streamed`);
  assert.equal(finish, "length");
  assert.equal(usage.completion_tokens, ref.generated_ids.length);
  assert.equal(usage.prompt_tokens, ref.prompt_ids.length);

  // The wire format itself: `data: {json}` events, the last one `data: [DONE]`.
  const res = await fetch(`${service.url}/v1/completions`, {
    method: "POST", headers: { Authorization: `Bearer ${KEY}` },
    body: JSON.stringify({ prompt: PROMPT, max_tokens: 3, temperature: 0, stream: true }) });
  assert.equal(res.status, 200);
  assert.match(res.headers.get("content-type"), /^text\/event-stream/);
  const events = (await res.text()).split("\n\n").filter((e) => e.length > 0);
  assert.equal(events.at(-1), "data: [DONE]");
  for (const e of events.slice(0, -1)) JSON.parse(e.replace(/^data: /, ""));
});

test("stop strings and seeds", async () => {
  const ref = generateReference(args.pinfer, args.model, PROMPT, MAX_TOKENS);
  const word = ref.text.trim().split(/\s+/)[1];  // a word in the middle of the greedy text
  const c = await client.completions.create({
    prompt: PROMPT, max_tokens: MAX_TOKENS, temperature: 0, stop: [word] });
  assert.equal(c.choices[0].finish_reason, "stop");
  assert.ok(ref.text.startsWith(c.choices[0].text) && !c.choices[0].text.includes(word),
            JSON.stringify([c.choices[0].text, word]));
  const sampled = async () => (await client.completions.create({
    prompt: PROMPT, max_tokens: 16, temperature: 1, top_p: 0.9, seed: 1234 })).choices[0].text;
  assert.equal(await sampled(), await sampled());
});

// The chat's reference: `pinfer chat-template` renders the messages, `pinfer generate` continues.
function chatReference() {
  const file = path.join(service.dir, "messages.json");
  fs.writeFileSync(file, JSON.stringify(MESSAGES));
  const prompt = execFileSync(args.pinfer, ["chat-template", "--model", args.model, "--template",
                                            TEMPLATE, "--messages", file], { encoding: "utf8" });
  return generateReference(args.pinfer, args.model, prompt, MAX_TOKENS);
}

test("chat completion at temperature 0 equals pinfer generate on the rendered prompt", async () => {
  const ref = chatReference();
  const c = await client.chat.completions.create({
    model: modelId, messages: MESSAGES, max_tokens: MAX_TOKENS, temperature: 0, logprobs: true });
  assert.equal(c.object, "chat.completion");
  assert.equal(c.choices[0].message.role, "assistant");
  assert.equal(c.choices[0].message.content, ref.text);
  assert.equal(c.usage.prompt_tokens, ref.prompt_ids.length);
  assert.equal(c.usage.completion_tokens, ref.generated_ids.length);
  assert.equal(c.choices[0].logprobs.content.map((t) => t.token).join(""), ref.text);

  const stream = await client.chat.completions.create({
    messages: MESSAGES, max_completion_tokens: MAX_TOKENS, temperature: 0, stream: true,
    stream_options: { include_usage: true } });
  let text = "", role = null, usage = null, finish = null, chunks = 0;
  for await (const chunk of stream) {
    assert.equal(chunk.object, "chat.completion.chunk");
    if (chunk.usage) usage = chunk.usage;
    for (const ch of chunk.choices) {
      if (ch.delta.role) role = ch.delta.role;
      if (ch.delta.content) {
        text += ch.delta.content;
        chunks += 1;
      }
      if (ch.finish_reason) finish = ch.finish_reason;
    }
  }
  assert.equal(role, "assistant");
  assert.equal(text, ref.text);
  assert.ok(chunks > 1);
  assert.equal(finish, ref.finish_reason === "length" ? "length" : "stop");
  assert.equal(usage.completion_tokens, ref.generated_ids.length);
});

test("bad input gets its status and an error object", async () => {
  assertError(await post("/v1/completions", "{not json"), 400);
  assertError(await post("/v1/completions", "[1, 2]"), 400);
  assertError(await post("/v1/completions", { prompt: PROMPT, temperature: "hot" }), 400,
              "temperature");
  assertError(await post("/v1/completions", { prompt: PROMPT, max_tokens: 1.5 }), 400,
              "max_tokens");
  assertError(await post("/v1/completions", { prompt: 42 }), 400, "prompt");
  assertError(await post("/v1/completions", { max_tokens: 2 }), 400, "prompt");
  assertError(await post("/v1/completions", { prompt: PROMPT, stream: "yes" }), 400, "stream");
  assertError(await post("/v1/completions", { prompt: PROMPT, presence_penalty: 0.5 }), 400,
              "presence_penalty");
  assertError(await post("/v1/completions", { prompt: PROMPT, n: 2 }), 400, "n");
  assertError(await post("/v1/chat/completions", { messages: "hi" }), 400, "messages");
  assertError(await post("/v1/chat/completions",
                         { messages: [{ role: "wizard", content: "hi" }] }), 400);
  assertError(await post("/v1/chat/completions",
                         { messages: MESSAGES, top_logprobs: 3, logprobs: true }), 400,
              "top_logprobs");
  assertError(await post("/v1/completions", { prompt: PROMPT, max_tokens: 100000 }), 400);
  assertError(await post("/v1/completions", { model: "gpt-4", prompt: PROMPT }), 404, "model");
  assertError(await post("/v1/nothing-here", {}), 404);
  const huge = JSON.stringify({ prompt: "a".repeat(2 << 20) });
  assertError(await post("/v1/completions", huge), 413);
  await stillServes();
});

test("the API key is required and checked", async () => {
  const wrong = new OpenAI({ baseURL: `${service.url}/v1`, apiKey: KEY + "x", maxRetries: 0 });
  await assert.rejects(wrong.models.list(), (e) => e.status === 401 && e.error?.type !== undefined);
  assertError(await post("/v1/completions", { prompt: PROMPT }, { Authorization: "" }), 401);
  // The page and the health check stay open (probes, and the page asks for the key).
  assert.equal((await fetch(`${service.url}/health`)).status, 200);
  assert.equal((await fetch(`${service.url}/`)).status, 200);
  await stillServes();
});

test("a slow client does not hold up others", async () => {
  const port = Number(new URL(service.url).port);
  const slow = net.connect(port, "127.0.0.1");
  await new Promise((r) => slow.on("connect", r));
  slow.write("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro");
  const start = Date.now();
  await stillServes();
  assert.ok(Date.now() - start < 5000);
  slow.destroy();
});

test("a client that leaves mid-stream cancels its generation", async () => {
  const before = await scrape(service.metricsUrl);
  const cancelledKey = 'pinfer_request_failures_total{code="CANCELLED"}';
  const controller = new AbortController();
  // ignore_eos: long enough (2000 tokens) that the generation cannot end by itself in time.
  const res = await fetch(`${service.url}/v1/completions`, {
    method: "POST", headers: { Authorization: `Bearer ${KEY}` }, signal: controller.signal,
    body: JSON.stringify({ prompt: PROMPT, max_tokens: 2000, ignore_eos: true, stream: true }) });
  const reader = res.body.getReader();
  await reader.read();  // the first chunk: the generation runs
  controller.abort();
  const deadline = Date.now() + 3000;
  let m;
  do {
    await new Promise((r) => setTimeout(r, 50));
    m = await scrape(service.metricsUrl);
  } while (Date.now() < deadline &&
           !(m[cancelledKey] > before[cancelledKey] && m.pinfer_requests_running === 0));
  assert.ok(m[cancelledKey] > before[cancelledKey], "the gateway saw no cancellation");
  assert.equal(m.pinfer_requests_running, 0);
  assert.ok(m.pinfer_generation_tokens_total - before.pinfer_generation_tokens_total < 2000);
  await stillServes();
});

test("a client that leaves before a reply that is not streamed cancels its generation",
     async () => {
  const before = await scrape(service.metricsUrl);
  const cancelledKey = 'pinfer_request_failures_total{code="CANCELLED"}';
  const controller = new AbortController();
  // Nothing is written to this client until the generation ends, so only the gateway's watch on
  // its socket can notice that it left.
  const pending = fetch(`${service.url}/v1/chat/completions`, {
    method: "POST", headers: { Authorization: `Bearer ${KEY}` }, signal: controller.signal,
    body: JSON.stringify({ messages: MESSAGES, max_tokens: 1900, ignore_eos: true }) })
    .catch((e) => e);
  let m;
  const started = Date.now() + 5000;
  do {  // wait until the generation runs
    await new Promise((r) => setTimeout(r, 20));
    m = await scrape(service.metricsUrl);
  } while (Date.now() < started && !(m.pinfer_requests_running > 0));
  assert.ok(m.pinfer_requests_running > 0, "the generation never started");
  controller.abort();
  assert.equal((await pending).name, "AbortError");
  const deadline = Date.now() + 3000;
  do {
    await new Promise((r) => setTimeout(r, 50));
    m = await scrape(service.metricsUrl);
  } while (Date.now() < deadline &&
           !(m[cancelledKey] > (before[cancelledKey] ?? 0) && m.pinfer_requests_running === 0));
  assert.ok(m[cancelledKey] > (before[cancelledKey] ?? 0), "the gateway saw no cancellation");
  assert.equal(m.pinfer_requests_running, 0);
  assert.ok(m.pinfer_generation_tokens_total - before.pinfer_generation_tokens_total < 1900);
  await stillServes();
});

test("HTTP requests are in the metrics by route and status", async () => {
  const m = await scrape(service.metricsUrl);
  const count = (path, code) => m[`pinfer_http_requests_total{code="${code}",path="${path}"}`] ?? 0;
  assert.ok(count("/v1/completions", 200) >= 5);
  assert.ok(count("/v1/completions", 400) >= 5);
  assert.ok(count("/v1/completions", 413) >= 1);
  assert.ok(count("/v1/models", 401) >= 1);
  assert.ok(m['pinfer_http_request_duration_seconds_count{path="/v1/completions"}'] >= 5);
});
