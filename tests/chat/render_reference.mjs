// Renders every chat template of cases.json with Hugging Face's own Jinja renderer
// (@huggingface/jinja, pinned in package-lock.json), the independent reference for shared/chat.
//   node render_reference.mjs          rewrites expected.json (the committed golden outputs)
//   node render_reference.mjs --check  exits 1 when the reference no longer renders expected.json
// A template that raises (raise_exception, or an error) records {"error": message} instead.
import { readFileSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { Template } from "@huggingface/jinja";

const here = dirname(fileURLToPath(import.meta.url));
const cases = JSON.parse(readFileSync(join(here, "cases.json"), "utf8"));

function render(source, context) {
  try {
    return { output: new Template(source).render(context) };
  } catch (error) {
    return { error: String(error.message) };
  }
}

const expected = {};
for (const [name, tokens] of Object.entries(cases.templates)) {
  const source = readFileSync(join(here, "templates", name), "utf8");
  const results = {};
  const sets = Object.entries(cases.message_sets).map(([set, messages]) => [set, messages, {}]);
  if (cases.tool_cases.templates.includes(name)) {
    sets.push(["tools", cases.tool_cases.messages, { tools: cases.tool_cases.tools }]);
  }
  for (const [set, messages, extra] of sets) {
    for (const addGenerationPrompt of [true, false]) {
      const context = { ...cases.context, ...tokens, ...extra, messages, add_generation_prompt: addGenerationPrompt };
      results[`${set}/${addGenerationPrompt ? "with" : "without"}_generation_prompt`] = render(source, context);
    }
  }
  expected[name] = results;
}

// Small templates for one construct each, rendered with the multi-turn messages.
for (const [name, source] of Object.entries(cases.snippets)) {
  const context = { ...cases.context, bos_token: "<s>", eos_token: "</s>", messages: cases.message_sets["multi-turn"] };
  expected[`snippet:${name}`] = { "multi-turn/with_generation_prompt": render(source, { ...context, add_generation_prompt: true }) };
}

const text = JSON.stringify(expected, null, 1) + "\n";
const path = join(here, "expected.json");
if (process.argv.includes("--check")) {
  if (readFileSync(path, "utf8") !== text) {
    console.error("expected.json differs from what @huggingface/jinja renders now");
    process.exit(1);
  }
  console.log("expected.json matches @huggingface/jinja");
} else {
  writeFileSync(path, text);
}
