// Starts `pinfer serve` on port 0 with the HTTP API for the HTTP tests (the OpenAI client test
// and the browser test), the way tests/service/python_client_test.py does for gRPC: ports come
// back through port files, and the service is used once /health says a worker is ready.
import { spawn, execFileSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";

export const SKIP = 77;  // ctest's SKIP_RETURN_CODE for these tests

export function parseArgs(argv) {
  const out = {};
  for (let i = 0; i < argv.length; i += 2) out[argv[i].replace(/^--/, "")] = argv[i + 1];
  for (const k of ["pinfer", "model"]) {
    if (!out[k]) throw new Error(`--${k} is required`);
  }
  return out;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function waitFor(pred, seconds, what) {
  const end = Date.now() + seconds * 1000;
  while (Date.now() < end) {
    const v = await pred();
    if (v) return v;
    await sleep(50);
  }
  throw new Error(`timed out waiting for ${what}`);
}

function readPort(file) {
  try {
    const n = parseInt(fs.readFileSync(file, "utf8"), 10);
    return Number.isFinite(n) && n > 0 ? n : null;
  } catch {
    return null;
  }
}

// Starts the service; `apiKey` (optional) goes through --api-key-file. Returns {url, metricsUrl,
// stop(), log()}.
export async function startService({ pinfer, model, apiKey, extra = [] }) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "pinfer-http-"));
  const files = Object.fromEntries(
    ["port", "hport", "mport", "key", "serve.log"].map((k) => [k, path.join(dir, k)]));
  const args = ["serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
                "--port-file", files.port, "--http-port", "0", "--http-port-file", files.hport,
                "--metrics-port", "0", "--metrics-port-file", files.mport, ...extra];
  if (apiKey) {
    fs.writeFileSync(files.key, apiKey + "\n");
    args.push("--api-key-file", files.key);
  }
  const log = fs.openSync(files["serve.log"], "w");
  const proc = spawn(pinfer, args, { stdio: ["ignore", log, log] });
  let exited = false;
  proc.on("exit", () => { exited = true; });
  const service = {
    dir,
    log: () => fs.readFileSync(files["serve.log"], "utf8"),
    stop: async () => {
      if (!exited) {
        proc.kill("SIGTERM");
        await waitFor(() => exited, 30, "pinfer serve to stop").catch(() => proc.kill("SIGKILL"));
      }
      fs.closeSync(log);
      fs.rmSync(dir, { recursive: true, force: true });
    },
  };
  try {
    const hport = await waitFor(() => exited ? Promise.reject(new Error("serve exited")) :
                                       readPort(files.hport), 60, "the HTTP port file");
    const mport = await waitFor(() => readPort(files.mport), 60, "the metrics port file");
    service.url = `http://127.0.0.1:${hport}`;
    service.metricsUrl = `http://127.0.0.1:${mport}/metrics`;
    await waitFor(async () => {
      try {
        return (await fetch(`${service.url}/health`)).status === 200;
      } catch {
        return false;
      }
    }, 60, "/health to answer 200");
  } catch (e) {
    console.error(service.log());
    await service.stop();
    throw e;
  }
  return service;
}

// The Prometheus text format as {"name{labels}": value}.
export async function scrape(metricsUrl) {
  const text = await (await fetch(metricsUrl)).text();
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const i = line.lastIndexOf(" ");
    out[line.slice(0, i)] = parseFloat(line.slice(i + 1));
  }
  return out;
}

// `pinfer generate` at temperature 0: the reference the HTTP answers must equal.
export function generateReference(pinfer, model, prompt, maxTokens) {
  const out = execFileSync(pinfer, ["generate", "--model", model, "--prompt", prompt,
                                    "--max-tokens", String(maxTokens), "--temperature", "0",
                                    "--json"], { encoding: "utf8", stdio: ["ignore", "pipe", "ignore"] });
  return JSON.parse(out);
}

export async function importOrSkip(name) {
  try {
    return await import(name);
  } catch {
    console.log(`SKIP: npm package ${name} is not installed (cd tests/http && npm ci)`);
    process.exit(SKIP);
  }
}
