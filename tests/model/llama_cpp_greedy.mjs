// Loads a GGUF file in llama.cpp (node-llama-cpp's prebuilt CPU build, one thread), tokenizes a
// prompt with BOS and decodes greedily; prints {prompt_ids, generated_ids} as JSON.
//
// usage: node llama_cpp_greedy.mjs MODEL.gguf PROMPT N_TOKENS
import {getLlama} from "node-llama-cpp";

const [modelPath, prompt, n] = process.argv.slice(2);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error", maxThreads: 1});
const model = await llama.loadModel({modelPath, gpuLayers: 0});
const context = await model.createContext({contextSize: 256, threads: {ideal: 1, min: 1}});
const ids = [model.tokens.bos, ...model.tokenize(prompt)];
const seq = context.getSequence();
const out = [];
for await (const token of seq.evaluate(ids, {temperature: 0})) {
  out.push(token);
  if (out.length >= Number(n)) break;
}
console.log(JSON.stringify({prompt_ids: ids, generated_ids: out}));
await context.dispose();
await model.dispose();
