// The chat page at / in a real browser: headless Chromium (Debian `chromium`) driven by npm
// `puppeteer-core`, against `pinfer serve` on the bundled model with --api-key and a ChatML
// template. The page must load with no request leaving the machine (it is self-contained),
// stream a reply to a typed message whose text is the service's own greedy chat answer (asked
// for separately over the API), show tokens/s and the GPU/CPU split, and say so when the key is
// wrong. Saves a screenshot to docs/images/chat-page.png when PINFER_SCREENSHOT is set.
//
//   node tests/http/chat_page_test.mjs --pinfer build/cli/pinfer --model models/relu-llama-tiny
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { test, after, before } from "node:test";

import { importOrSkip, parseArgs, SKIP, startService } from "./service.mjs";

const REPO = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
const { default: puppeteer } = await importOrSkip("puppeteer-core");
const CHROMIUM = ["/usr/bin/chromium", "/usr/bin/chromium-browser"].find((p) => fs.existsSync(p));
if (!CHROMIUM) {
  console.log("SKIP: no chromium (apt-get install chromium)");
  process.exit(SKIP);
}
const args = parseArgs(process.argv.slice(2));
const KEY = "sk-page-" + Math.random().toString(36).slice(2);
const MESSAGE = "Tell me a story about a cat.";

let service, browser;
before(async () => {
  service = await startService({
    ...args, apiKey: KEY,
    extra: ["--chat-template", path.join(REPO, "examples/chat-templates/chatml.jinja")] });
  browser = await puppeteer.launch({
    executablePath: CHROMIUM, headless: true,
    args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"] });
});
after(async () => {
  if (browser) await browser.close();
  if (service) await service.stop();
});

// What the page should show: the same conversation over the API, greedy, with the gateway's
// default length (the page sends none).
async function expectedReply() {
  const res = await fetch(`${service.url}/v1/chat/completions`, {
    method: "POST", headers: { Authorization: `Bearer ${KEY}` },
    body: JSON.stringify({ messages: [{ role: "user", content: MESSAGE }], temperature: 0 }) });
  const j = await res.json();
  assert.equal(res.status, 200, JSON.stringify(j));
  return j.choices[0].message.content;
}

async function openPage(key) {
  const page = await browser.newPage();
  await page.setViewport({ width: 960, height: 600 });
  const foreign = [];
  page.on("request", (r) => {
    if (!r.url().startsWith(service.url)) foreign.push(r.url());
  });
  await page.goto(service.url + "/", { waitUntil: "networkidle0" });
  await page.evaluate((k) => {
    const input = document.getElementById("key");
    input.value = k;
    input.dispatchEvent(new Event("change"));
  }, key);
  return { page, foreign };
}

async function sendMessage(page, text) {
  await page.type("#input", text);
  await page.keyboard.press("Enter");
  // Done when the send button is enabled again after the reply.
  await page.waitForFunction(
    () => document.querySelectorAll(".msg").length >= 2 && !document.getElementById("send").disabled,
    { timeout: 60000 });
}

test("the page streams a reply with tokens/s, using the API key", async () => {
  const want = await expectedReply();
  const { page, foreign } = await openPage(KEY);
  // Greedy, to compare with the API's answer; and count the reply's updates as they stream in.
  await page.evaluate(() => {
    document.getElementById("temperature").value = "0";
    window.replyUpdates = 0;
    new MutationObserver(() => { window.replyUpdates += 1; }).observe(
      document.getElementById("log"), { childList: true, subtree: true, characterData: true });
  });
  await page.waitForFunction(() => !/\?/.test(document.getElementById("split").textContent));
  await sendMessage(page, MESSAGE);
  const msgs = await page.$$eval(".msg", (els) => els.map((e) => [e.className, e.textContent]));
  assert.deepEqual(msgs[0], ["msg user", MESSAGE]);
  assert.deepEqual(msgs[1], ["msg assistant", want]);
  const updates = await page.evaluate(() => window.replyUpdates);
  assert.ok(updates > 5, `${updates} updates of the page: the reply was not streamed`);
  const speed = await page.$eval("#speed", (e) => e.textContent);
  assert.match(speed, /^tokens\/s: \d+(\.\d)?$/);
  assert.match(await page.$eval("#split", (e) => e.textContent), /GPU\/CPU neurons: \d/);
  assert.deepEqual(foreign, []);
  if (process.env.PINFER_SCREENSHOT) {
    await page.screenshot({ path: process.env.PINFER_SCREENSHOT });
  }
  await page.close();
});

test("a wrong key shows the service's error", async () => {
  const { page } = await openPage(KEY + "x");
  await sendMessage(page, "hello");
  const [cls, text] = await page.$eval(".msg:nth-of-type(2)", (e) => [e.className, e.textContent]);
  assert.equal(cls, "msg error");
  assert.match(text, /API key/);
  await page.close();
});
